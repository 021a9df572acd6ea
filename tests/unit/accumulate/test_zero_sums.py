"""``zero_sums``: ZeRO-1 and ZeRO-2, the optimizer (and sum) on shards.

The settings checked together, naming the argument (``check``); the mesh
they need (``check_mesh``); the first state, ``inner``'s in shards and the
sum whole (ZeRO-1) or in shards (ZeRO-2); each call's partials scattered
into a sharded sum with the lazy reset; the emit's reduction to shards.
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
from optax_accum._src import names
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import zero_sums

pytestmark = accumulate_parts.needs_unreduced_types

SETTINGS = accumulate_parts.SETTINGS
ONCE, EVERY = names.ONCE, names.EVERY_MICROBATCH
# "w" is sharded over "data" (8 rows); "odd" (3 entries) is kept whole.
PARTS = {"w": np.arange(N * N * 2, dtype=np.float32).reshape(N, N, 2),
         "odd": np.arange(N * 3, dtype=np.float32).reshape(N, 3)}


def _check(shard_optimizer="data", gradient_sync=ONCE, axis_name=None,
           with_stats=False, grad_reduction=None):
  return zero_sums.check(shard_optimizer, gradient_sync, axis_name,
                         with_stats, grad_reduction)


def _init(sync, inner, params):
  """``tx.init``'s state with ``shard_optimizer="data"``."""
  layout = zero_sums.ZeroSums(("data",), sync, local_sums.SingleSums())
  return state_lib.first_state(layout.init(inner, params, SETTINGS))


def _params():
  return {"w": jnp.zeros((N, 2)), "odd": jnp.zeros(3)}


def _partials():
  """Typed unreduced over "data": device i's part is PARTS' row i."""
  return {k: accumulate_parts.unreduced_from_slots(
      jax.device_put(v, P("data"))) for k, v in PARTS.items()}


def _spec(x):
  """``x``'s spec entries, without the trailing Nones."""
  entries = list(jax.typeof(x).sharding.spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def test_check_gives_the_settings_or_none():
  assert _check(None) is None
  assert _check() == zero_sums.Zero(("data",), ONCE)
  assert _check(("replica", "fsdp"), EVERY) == zero_sums.Zero(
      ("replica", "fsdp"), EVERY)


@pytest.mark.parametrize("kwargs,named", [
    (dict(gradient_sync="deferred"), "gradient_sync must be one of"),
    (dict(shard_optimizer=None, gradient_sync=EVERY),
     "gradient_sync='every_microbatch' shards.*pass shard_optimizer too"),
    (dict(axis_name="data"),
     "shard_optimizer='data' with axis_name='data'.*leave axis_name out"),
    (dict(with_stats=True), r"takes neither with_stats.*with_stats=True"),
    (dict(grad_reduction="max"), "grad_reduction='max'"),
])
def test_check_names_the_argument(kwargs, named):
  with pytest.raises(ValueError, match=named):
    _check(**kwargs)


@pytest.mark.parametrize("shard_optimizer", [3, (), ("data", 1)])
def test_a_bad_shard_optimizer_is_named_as_such(shard_optimizer):
  with pytest.raises(TypeError, match="shard_optimizer"):
    _check(shard_optimizer)


def test_check_mesh_names_a_missing_mesh_or_axis():
  with pytest.raises(ValueError, match=r"shard_optimizer=\('data',\).*got"
                     " no mesh"):
    zero_sums.check_mesh(("data",))
  auto = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  for mesh, axes in ((auto, ("data",)),
                     (accumulate_parts.explicit_mesh(), ("batch",))):
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="Explicit"):
      zero_sums.check_mesh(axes)
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    zero_sums.check_mesh(("data",))


@pytest.mark.parametrize("sync", [ONCE, EVERY])
def test_init_shards_the_inner_state_and_with_zero2_the_sum(sync):
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    state = _init(sync, optax.adam(0.1), _params())
  mu = state.inner_state[0].mu
  assert _spec(mu["w"]) == ("data",) and _spec(mu["odd"]) == ()
  assert _spec(state.grad_sum["w"]) == (("data",) if sync == EVERY else ())
  assert _spec(state.grad_sum["odd"]) == ()
  assert jax.tree.map(jnp.shape, state.grad_sum) == jax.tree.map(
      jnp.shape, _params())


def test_the_emit_reduces_the_sum_to_the_shards():
  """ZeRO-1: an unreduced sum is reduce-scattered; a whole one (reduced
  gradients) is sliced; a leaf kept whole is reduced whole."""
  layout = zero_sums.ZeroSums(("data",), ONCE, typed_sums.TypedSums())
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    whole = jnp.ones((N, 2))
    cycle = sum_layout.Cycle({"w": _partials()["w"], "whole": whole,
                              "odd": _partials()["odd"]},
                             jnp.float32(1.0), None, None)
    reduced = jax.jit(layout.reduced, static_argnums=1)(cycle, None)
    specs = jax.tree.map(_spec, reduced.grad_sum)
  assert specs == {"w": ("data",), "whole": ("data",), "odd": ()}
  helpers.assert_trees_equal(reduced.grad_sum, {
      "w": PARTS["w"].sum(0), "whole": np.ones((N, 2), np.float32),
      "odd": PARTS["odd"].sum(0)})


@pytest.mark.parametrize("cycle_start", [True, False])
def test_zero2_scatters_each_calls_partials_into_the_sharded_sum(
    cycle_start):
  """The sharded sum restarts lazily (the stored one not read, NaN or not)
  or adds; the leaf no axis shards keeps the typed form's unreduced sum."""
  layout = zero_sums.ZeroSums(("data",), EVERY, typed_sums.TypedSums())
  stored = {"w": jnp.full((N, 2), np.nan if cycle_start else 1.0),
            "odd": jnp.zeros(3)}

  @jax.jit
  def add(state, grads):
    step = layout.add(sum_layout.Incoming(grads, 2.0, jnp.float32(2.0), None),
                      state, None, SETTINGS)
    return jax.tree.map(typed_sums.reduce_sum, step.cycle.grad_sum)

  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    state = _init(EVERY, optax.sgd(1.0), _params())
    state = state._replace(
        micro_step=jnp.int32(0 if cycle_start else 1),
        grad_sum=zero_sums.sharded(stored, ("data",)))
    sums = add(state, _partials())
    assert _spec(sums["w"]) == ("data",)
  expected_w = 2.0 * PARTS["w"].sum(0) + (0.0 if cycle_start else 1.0)
  helpers.assert_trees_equal(sums, {"w": expected_w,
                                    "odd": 2.0 * PARTS["odd"].sum(0)})


def test_zero_sums_leave_reduced_gradients_to_the_single_form():
  """Reduced gradients (nothing typed unreduced): the single form's add,
  with ZeRO-1 and ZeRO-2 alike."""
  params = {"w": jnp.zeros((N, 2))}
  grads = {"w": jnp.ones((N, 2))}
  incoming = sum_layout.Incoming(grads, 3.0, jnp.float32(3.0), None)
  for sync in (ONCE, EVERY):
    layout = zero_sums.ZeroSums(("data",), sync, local_sums.SingleSums())
    with jax.set_mesh(accumulate_parts.explicit_mesh()):
      state = _init(sync, optax.sgd(1.0), params)
      step = jax.jit(lambda s, g, layout=layout: layout.add(
          incoming._replace(grads=g), s, None, SETTINGS))(state, grads)
    helpers.assert_trees_equal(step.cycle.grad_sum,
                               {"w": np.full((N, 2), 3.0, np.float32)})


def test_a_sharding_error_gets_the_note_for_whole_matrix_optimizers():
  error = TypeError("Contracting dimensions")
  zero_sums.note_for_matrices(error)
  assert "Muon" in "".join(error.__notes__)
