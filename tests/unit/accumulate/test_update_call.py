"""``update_call``: one ``update`` call, its form decided once.

``layout_for`` is the one place the form is decided, for ``init`` and
for each call, from the settings (``axis_name``, ``shard_optimizer``) and
where the call runs with what types; the emit decision is the ``every_k``
rule OR the caller's ``emit``, which can end a cycle early but never hold
one open.
"""

import types

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import optax_accum as oa
from optax_accum._src import names
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import update_call
from optax_accum._src.accumulate import zero_sums

WHOLE = {"w": jnp.zeros(2)}
ZERO1 = zero_sums.Zero(("data",), names.ONCE)


def _decide(axis_name, zero, updates, grad_sum, inner_state):
  """The form of an update call of these gradients on such a state."""
  settings = accumulate_parts.SETTINGS._replace(axis_name=axis_name,
                                                zero=zero)
  state = types.SimpleNamespace(grad_sum=grad_sum, inner_state=inner_state)
  return update_call.layout_for(settings, None, state, updates)


def _unreduced():
  return {"w": accumulate_parts.unreduced_from_slots(
      jax.device_put(np.ones((N, 2), np.float32), P("data")))}


def test_without_a_mesh_the_form_is_single():
  assert _decide(None, None, WHOLE, WHOLE, ()) == (
      local_sums.SingleSums())
  with pytest.raises(ValueError, match=r"shard_optimizer=\('data',\)"):
    _decide(None, ZERO1, WHOLE, WHOLE, ())


@accumulate_parts.needs_unreduced_types
def test_under_jit_the_types_and_the_settings_decide():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    partials = _unreduced()
    assert _decide(None, None, partials, WHOLE, ()) == typed_sums.TypedSums()
    assert _decide(None, None, WHOLE, partials, ()) == typed_sums.TypedSums()
    assert _decide(None, None, WHOLE, WHOLE, ()) == local_sums.SingleSums()
    assert _decide("data", None, partials, WHOLE, ()) == slot_sums.SlotSums(
        "data")
    assert _decide(None, ZERO1, partials, WHOLE, ()) == zero_sums.ZeroSums(
        ("data",), names.ONCE, typed_sums.TypedSums())
    assert _decide(None, ZERO1, WHOLE, WHOLE, ()) == zero_sums.ZeroSums(
        ("data",), names.ONCE, local_sums.SingleSums())
    # An inner state sharded over the gradients' unreduced axes (Flax's
    # optimizer_sharding): ZeRO-1 on its shards.
    rows = {"w": accumulate_parts.unreduced_from_slots(
        jax.device_put(np.ones((N, N), np.float32), P("data")))}
    moments = {"w": jax.device_put(jnp.zeros(N), P("data"))}
    assert _decide(None, None, rows, rows, moments) == (
        zero_sums.ZeroSums(("data",), names.ONCE, typed_sums.TypedSums(),
                           shards={"w": P("data")}, by_inner=True))


def test_init_lays_out_the_form_the_same_chooser_picks():
  """``init`` asks the chooser too: without gradients, by the settings (the
  typed form starts as the single one does)."""
  settings = accumulate_parts.SETTINGS
  assert update_call.layout_for(settings, WHOLE) == local_sums.SingleSums()
  assert update_call.layout_for(settings._replace(axis_name="data"),
                                WHOLE) == slot_sums.SlotSums("data")
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    assert update_call.layout_for(settings._replace(zero=ZERO1), WHOLE) == (
        zero_sums.ZeroSums(("data",), names.ONCE, local_sums.SingleSums()))


def test_inside_shard_map_the_form_is_manual():
  layouts = []

  def per_device(x):
    layouts.append(_decide("data", None, WHOLE, WHOLE, ()))
    return x

  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  jax.shard_map(per_device, mesh=mesh, in_specs=P("data"),
                out_specs=P("data"))(jnp.ones(N))
  assert layouts == [local_sums.ManualSums("data")]


@pytest.mark.parametrize("emit,micro_step,emits", [
    (None, 3, True), (None, 2, False),  # every_k alone.
    (True, 1, True),  # emit ends a cycle early,
    (False, 3, True),  # but never holds one open.
    (jnp.bool_(False), 2, False),
])
def test_emit_is_the_every_k_rule_or_the_callers(emit, micro_step, emits):
  length = update_call._cycle_length(3, jnp.int32(0))
  decided = update_call._should_emit(emit, jnp.int32(micro_step), length,
                                     local_sums.SingleSums())
  assert bool(decided) == emits


def test_without_every_k_only_emit_ends_a_cycle():
  assert update_call._cycle_length(None, jnp.int32(0)) is None
  layout = local_sums.SingleSums()
  assert not bool(update_call._should_emit(None, jnp.int32(99), None,
                                           layout))
  assert bool(update_call._should_emit(True, jnp.int32(1), None, layout))
  with pytest.raises(TypeError, match="emit must be a bool scalar"):
    update_call._should_emit(jnp.ones(2, bool), jnp.int32(1), None, layout)


def test_a_callable_every_k_gives_a_length_of_at_least_one():
  length = update_call._cycle_length(lambda count: count - 5, jnp.int32(2))
  assert int(length) == 1
  assert int(update_call._cycle_length(lambda count: 2 * count + 1,
                                       jnp.int32(2))) == 5
  with pytest.raises(TypeError, match=r"every_k\(count\) must return an"
                     r" integer scalar, got float32\[\]"):
    update_call._cycle_length(lambda count: 1.5 * count, jnp.int32(2))


def test_a_state_from_another_mesh_is_named():
  grad_fn = oa.value_and_grad(
      lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), num_microbatches=1,
      gradient_sync="deferred", equal_weights=True)
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, equal_weights=True)

  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    return tx.update(grads, state, params)[1]

  first = jax.make_mesh((2, 4), ("data", "model"),
                        axis_types=(AxisType.Explicit,) * 2)
  second = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  params = {"w": jnp.ones(3)}
  with jax.set_mesh(first):
    batch = {"x": jax.device_put(jnp.ones((16, 3)), P("data"))}
    state = jax.jit(step)(params, tx.init(params), batch)
  with jax.set_mesh(second):
    batch = {"x": jax.device_put(jnp.ones((16, 3)), P("data"))}
    with pytest.raises(ValueError, match=r"oa.reduced_state\(state\)"):
      jax.jit(step)(params, state, batch)


def test_each_devices_gradients_without_axis_name_are_named():
  # The shard_map recipe (oa.device_local) with axis_name forgotten.
  mesh = jax.make_mesh((8,), ("data",))
  tx = oa.accumulate(optax.adamw(0.1), every_k=2)
  params = {"w": jnp.ones(3)}

  def step(params, state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(
        oa.device_local(params, "data"))
    return oa.update_and_apply(tx, grads, state, params, num_tokens=2.0)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                            out_specs=(P(), P())))
  x = jax.device_put(jnp.ones((16, 3)), jax.NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"axis_name='data'\), which reduces"):
    f(params, tx.init(params), x)
