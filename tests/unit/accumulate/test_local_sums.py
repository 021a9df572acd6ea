"""``local_sums``: the sums each device holds itself (single and manual).

The single form adds whole gradients to one array like the parameter; the
manual form (inside ``jax.shard_map``) adds each device's own gradients to
its slot and sums the slots over the axis once, on emit. The slot helpers
lay a slot out per device where a mesh says how many there are.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import helpers
import optax_accum as oa
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import sum_layout

SETTINGS = accumulate_parts.SETTINGS


def _mesh(axis_type=AxisType.Explicit):
  return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def _per_device(fn, in_specs, out_specs):
  """``fn`` inside jax.shard_map over "data", under jit."""
  return jax.jit(jax.shard_map(fn, mesh=_mesh(AxisType.Auto),
                               in_specs=in_specs,
                               out_specs=out_specs))


def _sharded_over_slots(spec):
  """Whether ``spec`` splits the leading (slot) axis over "data" alone."""
  return spec[0] == "data" and all(e is None for e in spec[1:])


def test_single_sums_add_whole_gradients_weighted_by_their_tokens():
  params = {"w": jnp.zeros(3), "n": jnp.zeros(())}
  state = oa.accumulate(optax.sgd(1.0), 2).init(params)
  # Python scalars and NumPy arrays are gradients as optax takes them; an
  # integer leaf is averaged in the sum's dtype.
  grads = {"w": np.array([1.0, -2.0, 0.5], np.float32), "n": 2}
  step = local_sums.SingleSums().add(accumulate_parts.incoming(grads, 3),
                                     state, params, SETTINGS)
  helpers.assert_trees_equal(step.cycle.grad_sum,
                             {"w": jnp.array([3.0, -6.0, 1.5]),
                              "n": jnp.float32(6.0)})
  assert float(step.cycle.token_count) == 3.0
  assert step.leaf_rules is None and int(step.nonfinite_count) == 0


def test_single_sums_refuse_gradients_unlike_the_state():
  params = {"w": jnp.zeros(3)}
  state = oa.accumulate(optax.sgd(1.0), 2).init(params)
  with pytest.raises(ValueError, match=r"updates\['w'\]"):
    local_sums.SingleSums().add(
        accumulate_parts.incoming({"w": jnp.zeros(4)}, 1), state, params,
        SETTINGS)


def test_manual_sums_add_device_local_gradients_to_the_devices_slot():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")
  settings = SETTINGS._replace(axis_name="data")

  def add(params, local):
    state = tx.init(params)  # this device's one slot.
    grads = {"w": oa.device_local(params, "data")["w"] * (1.0 + local[0])}
    step = local_sums.ManualSums("data").add(
        accumulate_parts.incoming(grads, 2), state, params, settings)
    return step.cycle.grad_sum["w"], step.cycle.token_count

  params = {"w": jnp.ones(2)}
  local = jnp.arange(N, dtype=jnp.float32)[:, None]
  sums, counts = _per_device(add, (P(), P("data")), (P("data"), P("data")))(
      params, local)
  np.testing.assert_array_equal(sums, 2.0 * (1.0 + local) * jnp.ones((N, 2)))
  np.testing.assert_array_equal(counts, np.full(N, 2.0))


@pytest.mark.parametrize("num_tokens", [1, 0])
def test_manual_sums_refuse_a_gradient_autodiff_already_summed(num_tokens):
  """A gradient the same on every device (taken of replicated parameters) is
  refused; a flush (no tokens, known at trace time) is never looked at."""
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")

  def add(params):
    step = local_sums.ManualSums("data").add(
        accumulate_parts.incoming(params, num_tokens), tx.init(params), params,
        SETTINGS._replace(axis_name="data"))
    return step.cycle.token_count

  fn = _per_device(add, (P(),), P("data"))
  if num_tokens:
    with pytest.raises(ValueError, match=r"updates\['w'\] is the same on"
                       r" every device.*device_local"):
      fn({"w": jnp.ones(2)})
  else:
    np.testing.assert_array_equal(fn({"w": jnp.ones(2)}), np.zeros(N))


def test_manual_sums_reduce_the_slots_once_over_the_axis():
  """Each device's partial sums, summed over the axis; a "max" leaf is the
  maximum over the devices, not their sum."""

  def reduce(slot, count, rules):
    cycle = sum_layout.Cycle({"max": slot, "mean": slot}, count, None, None)
    reduced = local_sums.ManualSums("data").reduced(cycle, rules)
    return reduced.grad_sum, reduced.token_count

  slots = jnp.arange(2 * N, dtype=jnp.float32).reshape(N, 2)
  counts = jnp.arange(1, N + 1, dtype=jnp.float32)
  for rules in (["max", "mean"], None):
    sums, count = _per_device(
        lambda s, c, rules=rules: reduce(s, c, rules),
        (P("data"), P("data")), (P(), P()))(slots, counts)
    np.testing.assert_array_equal(sums["mean"], slots.sum(0))
    np.testing.assert_array_equal(
        sums["max"], slots.max(0) if rules else slots.sum(0))
    assert count.shape == () and float(count) == float(counts.sum())


def test_manual_sums_refuse_an_emit_that_varies_over_the_axis():
  layout = local_sums.ManualSums("data")

  def check(flags):
    layout.check_emit(flags[0] > 0)  # this device's own flag.
    return flags

  with pytest.raises(ValueError, match=r"emit varies over axis \['data'\]"):
    _per_device(check, (P("data"),), P("data"))(jnp.ones(N))

  def check_same(flags):
    layout.check_emit(jnp.bool_(True))
    return flags

  _per_device(check_same, (P("data"),), P("data"))(jnp.ones(N))


def test_zeros_with_slot_has_a_slot_per_device_where_a_mesh_says_how_many():
  assert slot_sums.zeros_with_slot((2,), jnp.float32, "data").shape == (1, 2)
  with jax.set_mesh(_mesh()):
    slots = slot_sums.zeros_with_slot((2,), jnp.float32, "data")
    assert _sharded_over_slots(jax.typeof(slots).sharding.spec)
  assert slots.shape == (N, 2)
  with jax.set_mesh(_mesh(AxisType.Auto)):
    slots = slot_sums.zeros_with_slot((2,), jnp.bfloat16, "data")
  assert slots.shape == (N, 2) and slots.dtype == jnp.bfloat16
  assert _sharded_over_slots(slots.sharding.spec)

  def inside(x):
    slot = slot_sums.zeros_with_slot((2,), jnp.float32, "data")
    assert slot.shape == (1, 2)
    return x

  _per_device(inside, (P("data"),), P("data"))(jnp.ones(N))


def test_slots_are_sharded_by_type_only_under_an_explicit_mesh():
  assert not slot_sums.slots_sharded_by_type("data")
  with jax.set_mesh(_mesh()):
    assert slot_sums.slots_sharded_by_type("data")
    assert not slot_sums.slots_sharded_by_type("model")  # not in the mesh.
  with jax.set_mesh(_mesh(AxisType.Auto)):
    assert not slot_sums.slots_sharded_by_type("data")

  def inside(x):
    assert not slot_sums.slots_sharded_by_type("data")  # bound: one slot.
    return x

  _per_device(inside, (P("data"),), P("data"))(jnp.ones(N))


def test_sum_slots_over_needs_the_axis_bound():
  with pytest.raises(ValueError, match="axis_name='data' is not bound here"):
    local_sums.sum_slots_over({"w": jnp.ones((1, 2))}, "data")
