"""``slot_sums``: unreduced gradients under jit, kept in a slot per device.

Which data axes a parameter's slots span (``slot_axes``), the slots laid
out like the parameter (``slots_like``), each device's partial added to its
own slot with the shared counts in device 0's (``add_to_slots``), the one
reduction on emit (``sum_slots``), and what the slots refuse.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import helpers
import optax_accum as oa
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import window_args

pytestmark = accumulate_parts.needs_unreduced_types

SETTINGS = accumulate_parts.SETTINGS._replace(axis_name="data")
PARTS = np.arange(2 * N, dtype=np.float32).reshape(N, 2)  # device i: row i.


def _partials():
  """Typed unreduced over "data": each device's row of PARTS."""
  return accumulate_parts.unreduced_from_slots(jax.device_put(PARTS, P("data")))


def _hsdp_mesh():
  return accumulate_parts.explicit_mesh((2, 4), ("replica", "fsdp"))


def _spec(x):
  return jax.typeof(x).sharding.spec


@pytest.mark.parametrize("param_spec,axis_name,axes", [
    (P(), "data", ("data",)),
    (None, ("replica", "fsdp"), ("replica", "fsdp")),
    (P("fsdp"), ("replica", "fsdp"), ("replica",)),
    (P(None, ("replica", "fsdp")), ("replica", "fsdp"), ()),
])
def test_slots_span_the_data_axes_that_do_not_shard_the_param(
    param_spec, axis_name, axes):
  assert slot_sums.slot_axes(param_spec, axis_name) == axes


def test_slots_like_lays_a_slot_per_device_beside_the_params_sharding():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    slots = slot_sums.slots_like(jnp.zeros(3), jnp.float32, "data")
    assert slots.shape == (N, 3) and _spec(slots)[0] == "data"
  with jax.set_mesh(_hsdp_mesh()):
    param = jax.device_put(jnp.zeros(8), P("fsdp"))
    slots = slot_sums.slots_like(param, jnp.bfloat16, ("replica", "fsdp"))
    assert slots.shape == (2, 8) and slots.dtype == jnp.bfloat16
    assert tuple(_spec(slots)) == ("replica", "fsdp")


def test_sum_slots_is_the_one_reduction_sharded_like_the_param():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    summed = jax.jit(slot_sums.sum_slots)(jax.device_put(PARTS, P("data")))
    assert not _spec(summed).unreduced
  np.testing.assert_array_equal(summed, PARTS.sum(0))
  # A parameter sharded over every data axis has one slot: no reduction.
  with jax.set_mesh(_hsdp_mesh()):
    one = jax.device_put(jnp.arange(8.0)[None], P(None, ("replica", "fsdp")))
    np.testing.assert_array_equal(jax.jit(slot_sums.sum_slots)(one),
                                  np.arange(8.0))


def test_slots_made_without_a_mesh_are_named():
  state = oa.accumulate(optax.sgd(1.0), 2, axis_name="data").init(
      {"w": jnp.zeros(2)})  # one slot, for pmap.
  with pytest.raises(ValueError, match=r"not laid out one slot per device:"
                     r" call tx\.init\(params\) under jax\.set_mesh"):
    slot_sums.sum_slots(state.grad_sum["w"])


def test_gradients_must_be_unreduced_over_exactly_their_slots_axes():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    grad_sum = tx.init({"w": jnp.zeros(2)}).grad_sum
    slot_sums.check_unreduced_over_slots({"w": _partials()}, grad_sum,
                                         "data", looked_at=True)
    with pytest.raises(ValueError, match=r"updates\['w'\] is not unreduced"
                       r" over \['data'\].*count an already reduced gradient"
                       " once per device"):
      slot_sums.check_unreduced_over_slots({"w": jnp.ones(2)}, grad_sum,
                                           "data", looked_at=True)
    # A flush's zeros are never added: a reduced one is fine there.
    slot_sums.check_unreduced_over_slots({"w": jnp.zeros(2)}, grad_sum,
                                         "data", looked_at=False)
  with pytest.raises(ValueError, match="axis_name='data' is not bound here"):
    slot_sums.check_unreduced_over_slots({"w": jnp.ones(2)}, grad_sum,
                                         "data", looked_at=True)


def test_gradients_unreduced_over_other_axes_are_named():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="replica")
  with jax.set_mesh(_hsdp_mesh()):
    grad_sum = tx.init({"w": jnp.zeros(2)}).grad_sum
    over_fsdp = accumulate_parts.unreduced_from_slots(
        jax.device_put(jnp.ones((4, 2)), P("fsdp")))
    with pytest.raises(ValueError, match=r"unreduced over \['fsdp'\], but the"
                       r" state keeps its per-device sums over"
                       r" \['replica'\]"):
      slot_sums.check_unreduced_over_slots({"w": over_fsdp}, grad_sum,
                                           "replica", looked_at=True)


def test_each_device_adds_its_partial_to_its_slot_and_counts_once():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")

  @jax.jit
  def add(state, grads):
    step = slot_sums.add_to_slots(grads, state, None, jnp.float32(2.0),
                                  SETTINGS, jnp.float32(0.5))
    return step, slot_sums.SlotSums("data").reduced(step.cycle, None)

  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    state = tx.init({"w": jnp.zeros(2)})
    step, reduced = add(state, {"w": _partials()})
  np.testing.assert_array_equal(step.cycle.grad_sum["w"], 2.0 * PARTS)
  first_only = np.eye(N, dtype=np.float32)[0]  # device 0's slot.
  np.testing.assert_array_equal(step.cycle.token_count, 2.0 * first_only)
  helpers.assert_trees_equal(
      step.cycle.value_sums,
      window_args.ValueSums(1.0 * first_only, 2.0 * first_only))
  # The emit's reduction: the slots summed, the counts to scalars.
  np.testing.assert_array_equal(reduced.grad_sum["w"], 2.0 * PARTS.sum(0))
  assert float(reduced.token_count) == 2.0
  assert float(reduced.value_sums.total) == 1.0
