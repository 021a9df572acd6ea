"""``state``: ``AccumulateState``'s fields, start and step.

A missing attribute points from other trainers' names to ours;
``tx.update`` changes nothing it is given, and the state a call returns
remembers the updates returned with it. Where the state's fields start
(``first_state``, around a form's ``init``) and what an emitting call
leaves in them (``next_state``).
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import accumulate_parts
import helpers
import optax_accum as oa
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import outputs
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args


def _grads(i=0):
  return {"w": jnp.full(3, 1.0 + i)}


def _state(inner=None, **kwargs):
  tx = oa.accumulate(inner or optax.adam(0.1), 2, **kwargs)
  return tx, tx.init(helpers.vector_params())


def _notes(error: BaseException) -> str:
  return "".join(getattr(error, "__notes__", []))


@pytest.mark.parametrize("theirs,ours", [
    ("gradient_step", "micro_step"), ("mini_step", "micro_step"),
    ("acc_grads", "grad_sum"), ("opt_state", "inner_state"),
])
def test_other_trainers_names_point_to_our_fields(theirs, ours):
  _, state = _state()
  with pytest.raises(AttributeError, match=f"no attribute '{theirs}'") as e:
    getattr(state, theirs)
  assert f"other trainers' '{theirs}' is oa.AccumulateState's '{ours}'" in (
      _notes(e.value))
  assert hasattr(state, ours)


def test_a_name_no_trainer_uses_gets_no_pointer():
  """Negative control: an unknown name raises without the note; a field of
  the inner state is read through ours; a private name never searches."""
  _, state = _state()
  with pytest.raises(AttributeError, match="no attribute 'moments'") as e:
    _ = state.moments
  assert "other trainers'" not in _notes(e.value)
  helpers.assert_trees_equal(state.mu, state.inner_state[0].mu)
  with pytest.raises(AttributeError, match=r"^_private$"):
    _ = state._private


def test_inner_field_names_every_place_a_field_is_found():
  inner = (optax.ScaleByAdamState(0, {"w": 1}, {"w": 2}),
           {"second": optax.ScaleByAdamState(0, {"w": 3}, {"w": 4})})
  with pytest.raises(AttributeError, match=r"2 fields of that name \(at"
                     r" state\.inner_state\[0\], state\.inner_state\[1\]"
                     r"\['second'\]\)"):
    state_lib.inner_field(inner, "mu")
  assert state_lib.inner_field(inner[:1], "nu") == {"w": 2}


def test_update_changes_nothing_it_is_given():
  tx, state = _state(equal_weights=True)
  before = jax.tree.map(lambda x: x, state)
  marks = dict(state.__dict__)
  _, new_state = tx.update(_grads(), state, helpers.vector_params())
  assert state.__dict__ == marks  # no attribute set on the argument.
  helpers.assert_trees_equal(before, state)
  assert new_state is not state


def test_a_state_copies_and_pickles_as_its_fields_alone():
  """The memory of the updates stays with the object: a copy or an
  unpickled state is a fresh one, equal leaf by leaf."""
  tx, state = _state(equal_weights=True)
  updates, new_state = tx.update(_grads(), state, helpers.vector_params())
  for clone in (copy.copy(new_state), copy.deepcopy(new_state),
                pickle.loads(pickle.dumps(new_state))):
    assert type(clone) is state_lib.AccumulateState
    helpers.assert_trees_equal(clone, new_state)
  assert state_lib.returned_with(new_state, updates)
  assert not state_lib.returned_with(copy.copy(new_state), updates)


def test_a_state_remembers_the_updates_returned_with_it():
  tx, state = _state(equal_weights=True)
  updates, state = tx.update(_grads(0), state, helpers.vector_params())
  assert state_lib.returned_with(state, updates)
  # Negative controls: equal values that are other arrays; another call's
  # updates; a tree with other leaves; a state that returned none.
  assert not state_lib.returned_with(state, jax.tree.map(jnp.copy, updates))
  later, next_state = tx.update(_grads(1), state, helpers.vector_params())
  assert not state_lib.returned_with(state, later)
  assert not state_lib.returned_with(next_state, updates)
  assert not state_lib.returned_with(state, {**updates, "b": updates["w"]})
  assert not state_lib.returned_with(tx.init(helpers.vector_params()), updates)


def test_updates_that_take_no_weak_reference_are_not_remembered():
  _, state = _state()
  state_lib.remember_updates(state, {"w": 1.0})  # a Python float.
  assert not state_lib.returned_with(state, {"w": 1.0})
  assert "returned" not in state.__dict__


def test_update_and_apply_remembers_no_updates():
  """It returns parameters, which are no updates to be swapped with them."""
  tx, state = _state(equal_weights=True)
  params, state = tx.update_and_apply(_grads(), state, helpers.vector_params())
  assert not state_lib.returned_with(state, params)
  assert "returned" not in state.__dict__


def _first_state(layout, params, **settings):
  settings = accumulate_parts.SETTINGS._replace(**settings)
  return state_lib.first_state(layout.init(optax.identity(), params,
                                           settings))


def test_each_form_lays_out_the_counts_by_axis_name():
  params = {"w": jnp.zeros((2, 3)), "c": jnp.zeros(2, jnp.complex64)}
  plain = _first_state(local_sums.SingleSums(), params, with_stats=True,
                       accumulator_dtype={"w": jnp.bfloat16, "c": None})
  assert plain.token_count.shape == plain.nonfinite_count.shape == ()
  assert plain.grad_sum["w"].dtype == jnp.bfloat16
  assert plain.grad_sum["c"].dtype == jnp.complex64
  assert plain.stats_sums is not None and plain.stats is not None
  # Outside a mesh, axis_name gives one slot (replicated for pmap).
  slotted = _first_state(local_sums.ManualSums("data"), params,
                         accumulator_dtype=jnp.float32, axis_name="data")
  assert slotted.grad_sum["w"].shape == (1, 2, 3)
  assert slotted.token_count.shape == slotted.skipped_count.shape == (1,)
  assert slotted.stats_sums is None and slotted.stats is None
  assert slotted.micro_step.shape == slotted.tokens_seen.shape == ()


def _step(state, token_count, grad_sum):
  cycle = sum_layout.Cycle(grad_sum, jnp.float32(token_count), None,
                           window_args.ValueSums(jnp.float32(5.0),
                                                 jnp.float32(2.0)))
  return sum_layout.MicroStep(grad_sum, None, cycle, jnp.int32(1),
                              jnp.int32(2))


@pytest.mark.parametrize("emitted", [True, False])
def test_next_state_resets_the_cycle_on_emit(emitted):
  _, state = _state(optax.sgd(1.0))
  buffer = {"w": jnp.arange(3.0)}
  outcome = outputs.Emitted(None, "inner", jnp.bool_(emitted), None,
                            jnp.float32(4.0 if emitted else 0.0))
  new = state_lib.next_state(state, jnp.int32(2), jnp.bool_(True),
                             _step(state, 4.0, buffer), outcome, buffer)
  assert int(new.micro_step) == 0 and float(new.token_count) == 0.0
  assert all(float(v) == 0.0 for v in jax.tree.leaves(new.value_sums))
  assert int(new.count) == int(emitted) and bool(new.emitted) == emitted
  assert new.inner_state == "inner" and new.grad_sum is buffer
  assert (int(new.nonfinite_count), int(new.skipped_count)) == (1, 2)
  assert float(new.tokens_seen) == (4.0 if emitted else 0.0)
  # Negative control: a call that does not emit keeps the cycle's sums.
  kept = state_lib.next_state(state, jnp.int32(1), jnp.bool_(False),
                              _step(state, 4.0, buffer), outcome, buffer)
  assert int(kept.micro_step) == 1 and float(kept.token_count) == 4.0


def test_next_state_counts_tokens_seen_without_rounding_them_away():
  """Kahan summation: 2**24 + 1 + 1 is 2**24 + 2, not float32's 2**24."""
  _, state = _state(optax.sgd(1.0))
  state = state._replace(tokens_seen=jnp.float32(2.0**24))
  one = outputs.Emitted(None, (), jnp.bool_(True), None, jnp.float32(1.0))
  for _ in range(2):
    state = state_lib.next_state(state, jnp.int32(1), jnp.bool_(True),
                                 _step(state, 1.0, state.grad_sum), one,
                                 state.grad_sum)
  assert float(state.tokens_seen) == 2.0**24 + 2
  naive = np.float32(2.0**24) + np.float32(1.0) + np.float32(1.0)
  assert naive == 2.0**24


def test_check_state_names_a_state_that_is_not_ours():
  _, state = _state()
  state_lib.check_state(_grads(), state, helpers.vector_params())
  with pytest.raises(TypeError, match=r"AccumulateState as its third"
                     r" argument \(params\)"):
    state_lib.check_state(_grads(), helpers.vector_params(), state)
  with pytest.raises(TypeError, match=r"An optax\.chain or another wrapper"):
    state_lib.check_state(_grads(), (state,), helpers.vector_params())
