"""``typed_sums``: the running sum of unreduced gradients kept unreduced.

The types say it all: which leaves are typed unreduced and over which axes
(``is_typed``, ``leaf_types``), a whole value entering the partials once
(on the first device), and the one reduction on emit (``reduce_sum``).
Arrays typed unreduced come from ``accumulate_parts.unreduced_from_slots``.
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
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums

pytestmark = accumulate_parts.needs_unreduced_types

SETTINGS = accumulate_parts.SETTINGS


def _slots(offset=0.0):
  """One slot per device of "data": device i's slot holds i + offset."""
  values = np.arange(N, dtype=np.float32)[:, None] + offset
  return np.broadcast_to(values, (N, 2)) * np.float32([1, -1])


def _partials(offset=0.0):
  """Typed unreduced over "data"; the reduction is ``_slots(...).sum(0)``."""
  return accumulate_parts.unreduced_from_slots(
      jax.device_put(_slots(offset), P("data")))


def test_is_typed_where_any_gradient_or_sum_is_unreduced():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    whole = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    assert not typed_sums.is_typed(whole, whole)
    assert typed_sums.is_typed({**whole, "b": _partials()}, whole)
    assert typed_sums.is_typed(whole, {**whole, "a": _partials()})


def test_leaf_types_say_which_side_is_partial():
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    partial, whole = _partials(), jnp.zeros(2)
    types = typed_sums.leaf_types([partial, whole, partial, whole],
                                  [whole, partial, partial, whole])
  assert types == [
      typed_sums.LeafTypes(("data",), False, True),
      typed_sums.LeafTypes(("data",), True, False),
      typed_sums.LeafTypes(("data",), True, True),
      typed_sums.LeafTypes((), False, False),
  ]


def test_leaf_types_name_a_gradient_from_other_axes_or_sharding():
  mesh = accumulate_parts.explicit_mesh((4, 2), ("data", "model"))
  with jax.set_mesh(mesh):
    over_data = accumulate_parts.unreduced_from_slots(
        jax.device_put(jnp.ones((4, 2)), P("data")))
    over_model = accumulate_parts.unreduced_from_slots(
        jax.device_put(jnp.ones((2, 2)), P("model")))
    split_by_model = accumulate_parts.unreduced_from_slots(
        jax.device_put(jnp.ones((4, 2)), P("data", "model")))
  with pytest.raises(ValueError, match=r"updates\['w'\] is unreduced over"
                     r" \['data'\], but the running sum of this cycle is"
                     r" unreduced over \['model'\]"):
    typed_sums.leaf_types({"w": over_data}, {"w": over_model})
  with pytest.raises(ValueError, match=r"updates\['w'\] is typed .*, sharded"
                     " unlike the running sum kept for it"):
    typed_sums.leaf_types({"w": split_by_model}, {"w": over_data})


def test_axis_name_must_name_the_axes_the_types_say():
  types = [typed_sums.LeafTypes(("data",), False, True),
           typed_sums.LeafTypes((), False, False)]
  typed_sums.check_axis_name_matches(types, None)
  typed_sums.check_axis_name_matches(types, ("data", "fsdp"))
  with pytest.raises(ValueError, match=r"accumulate\(axis_name='model'\) got"
                     r" gradients unreduced over \['data'\].*pass"
                     r" axis_name=\('data',\)"):
    typed_sums.check_axis_name_matches(types, "model")


def test_reduce_sum_reduces_only_what_is_unreduced():
  whole = jnp.arange(2.0)
  assert typed_sums.reduce_sum(whole) is whole
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    reduced = jax.jit(typed_sums.reduce_sum)(_partials())
    assert not jax.typeof(reduced).sharding.spec.unreduced
  np.testing.assert_array_equal(reduced, _slots().sum(0))


def test_a_whole_value_enters_the_partials_once():
  """A sum typed whole (a fresh or restored state) and a gradient JAX
  already reduced each count once when summed over the devices, not once
  per device; unreduced ones add their parts."""
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  stored = {"a": jnp.array([1.0, -1.0]), "b": None}  # b: partials below.
  reduced_grad = jnp.array([0.5, 2.0])

  @jax.jit
  def add(state, grads):
    step = typed_sums.add_partials(grads, state, params, jnp.float32(2.0),
                                   SETTINGS, None)
    return (jax.tree.map(typed_sums.reduce_sum, step.cycle.grad_sum),
            step.cycle.token_count)

  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    state = oa.accumulate(optax.sgd(1.0), 3).init(params)._replace(
        micro_step=jnp.int32(1), token_count=jnp.float32(1.0),
        grad_sum={"a": stored["a"], "b": _partials(offset=10.0)})
    sums, count = add(state, {"a": _partials(), "b": reduced_grad})
  helpers.assert_trees_equal(sums, {
      "a": stored["a"] + 2.0 * _slots().sum(0),
      "b": _slots(offset=10.0).sum(0) + 2.0 * reduced_grad,
  })
  assert float(count) == 3.0


def test_typed_sums_reduce_the_cycle_on_emit():
  layout = typed_sums.TypedSums()
  assert not layout.local
  layout.check_emit(jnp.bool_(True))
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    cycle = sum_layout.Cycle({"w": _partials(), "b": jnp.ones(2)},
                             jnp.float32(3.0), None, None)
    reduced = jax.jit(layout.reduced, static_argnums=1)(cycle, None)
  helpers.assert_trees_equal(reduced.grad_sum, {"w": _slots().sum(0),
                                                "b": jnp.ones(2)})
  assert float(reduced.token_count) == 3.0
