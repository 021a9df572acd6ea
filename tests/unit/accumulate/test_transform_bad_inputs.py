"""oa.accumulate and bad input: an error naming it, or a visible NaN.

Never a finite, wrong update and never a good micro-batch silently thrown
away. Each case says where it is caught: at construction, at trace time (also
under ``jax.jit``), or at run time (a traced value: the update comes out
non-finite, or the micro-step is dropped and counted under
``skip_nonfinite``).
"""

from decimal import Decimal
from fractions import Fraction
import functools
import math
import re

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

NAN, INF = float("nan"), float("inf")


def _grads(i):
  return {"w": jnp.arange(3.0) + i + 1.0}


# --------------------------------------------------------------------------
# num_tokens, concrete: caught at trace time (eagerly, or under jit as a
# constant).


@pytest.mark.parametrize("num_tokens", [
    NAN, INF, -INF, -1.0, -1, np.float32(NAN), np.int64(-3),
    jnp.float32(-2.0), jnp.float32(NAN),
])
@pytest.mark.parametrize("jit", [False, True])
def test_concrete_bad_num_tokens_raise_naming_it(num_tokens, jit):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  update = functools.partial(tx.update, _grads(0),
                             tx.init(helpers.vector_params()),
                             num_tokens=num_tokens)
  with pytest.raises(ValueError,
                     match=r"num_tokens must be a finite number >= 0, got"):
    jax.jit(update)() if jit else update()


@pytest.mark.parametrize("num_tokens", [
    "3", True, np.bool_(True), jnp.bool_(False), [3], (1 + 2j),
    np.complex64(1), Decimal("2"), {"n": 3},
])
def test_non_numeric_num_tokens_raise_naming_it(num_tokens):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  pattern = rf"num_tokens must be a real number.*{re.escape(repr(num_tokens))}"
  with pytest.raises(TypeError, match=pattern):
    tx.update(_grads(0), tx.init(helpers.vector_params()),
              num_tokens=num_tokens)


def test_traced_non_numeric_or_non_scalar_num_tokens_raise_at_trace_time():
  tx = oa.accumulate(optax.sgd(1.0), 2)
  update = jax.jit(tx.update)
  with pytest.raises(TypeError, match=r"num_tokens must be a real number"):
    update(_grads(0), tx.init(helpers.vector_params()),
           num_tokens=jnp.complex64(1))
  with pytest.raises(ValueError, match=r"num_tokens must be a scalar.*\(2,\)"):
    update(_grads(0), tx.init(helpers.vector_params()), num_tokens=jnp.ones(2))


@pytest.mark.parametrize("num_tokens, expected", [
    (2**40, 2.0**40), (Fraction(1, 2), 0.5), (np.uint8(3), 3.0),
    (jnp.float16(2.0), 2.0), (np.int64(5), 5.0), (-0.0, 0.0),
])
def test_unusual_but_good_num_tokens_are_counted(num_tokens, expected):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  _, state = tx.update(_grads(0), tx.init(helpers.vector_params()),
                       num_tokens=num_tokens)
  assert float(state.token_count) == expected


# --------------------------------------------------------------------------
# num_tokens, traced: caught at run time, visibly.


@pytest.mark.parametrize("bad", [NAN, INF, -1.0])
def test_traced_bad_num_tokens_is_visible_or_dropped_and_counted(bad):
  feed = [(_grads(0), 2.0), (_grads(1), bad), (_grads(2), 3.0)]
  for skip_nonfinite in (False, True):
    tx = oa.accumulate(optax.sgd(1.0), 3, skip_nonfinite=skip_nonfinite)
    state, update = tx.init(helpers.vector_params()), jax.jit(tx.update)
    for grads, n in feed:
      updates, state = update(grads, state, num_tokens=jnp.float32(n))
    if skip_nonfinite:
      expected = jax.tree.map(lambda a, b: -(2 * a + 3 * b) / 5,
                              _grads(0), _grads(2))
      helpers.assert_trees_close(updates, expected, rtol=1e-6)
      assert int(state.nonfinite_count) == 1
    else:
      assert np.all(np.isnan(updates["w"])), updates  # not zeros, not finite.
      assert bool(oa.has_updated(state))


# The property: whatever mix of good and bad counts, each emitted update is
# the exact mean of the cycle's good micro-steps, zeros for a cycle without
# tokens, or (a bad count not dropped) NaN. Never anything else.

_COUNTS = [1.0, 2.5, 7.0, 0.0, -0.0, NAN, INF, -INF, -1.0, -1e-3]


def _is_bad(n):
  return not math.isfinite(n) or n < 0


@functools.cache
def _jitted(skip_nonfinite, loss_reduction):
  # every_k=None: the loop's emit is the whole decision.
  tx = oa.accumulate(optax.sgd(1.0), None, skip_nonfinite=skip_nonfinite,
                     loss_reduction=loss_reduction)
  return tx, jax.jit(tx.update)


def _micro_grads(i, n):
  # A micro-batch without tokens has a 0/0 mean loss: NaN gradients.
  return {"w": jnp.full(3, NAN) if n == 0 else jnp.arange(3.0) * i + 1.0}


def _expected(cycle, skip_nonfinite, loss_reduction):
  """What the cycle's emitting call must return: an array, or "nan"."""
  if not skip_nonfinite and any(_is_bad(n) for _, n in cycle):
    return "nan"
  good = [(i, n) for i, n in cycle if not _is_bad(n) and n > 0]
  total = sum(n for _, n in good)
  if total == 0:
    return np.zeros(3, np.float32)
  weight = (lambda n: n) if loss_reduction == "mean" else (lambda n: 1.0)
  return -sum(weight(n) * np.asarray(_micro_grads(i, n)["w"])
              for i, n in good) / total


@hypothesis.settings(max_examples=30, deadline=None, database=None)
@hypothesis.given(
    counts=st.lists(st.sampled_from(_COUNTS), min_size=1, max_size=7),
    every_k=st.integers(1, 3),
    skip_nonfinite=st.booleans(),
    loss_reduction=st.sampled_from(["mean", "sum"]),
    concrete=st.booleans(),
)
@pytest.mark.slow
def test_bad_num_tokens_never_give_a_finite_wrong_update(
    counts, every_k, skip_nonfinite, loss_reduction, concrete):
  tx, update = _jitted(skip_nonfinite, loss_reduction)
  state, cycle, dropped = tx.init(helpers.vector_params()), [], 0
  for i, n in enumerate(counts):
    last = i == len(counts) - 1
    if concrete and _is_bad(n):  # caught before anything is computed.
      with pytest.raises(ValueError, match="num_tokens"):
        tx.update(_micro_grads(i, n), state, num_tokens=n)
      continue
    updates, state = update(_micro_grads(i, n), state,
                            num_tokens=jnp.float32(n), emit=jnp.bool_(
                                last or int(state.micro_step) + 1 >= every_k))
    cycle.append((i, n))
    dropped += skip_nonfinite and _is_bad(n)
    if int(state.micro_step) != 0:
      np.testing.assert_array_equal(updates["w"], np.zeros(3))
      continue
    expected = _expected(cycle, skip_nonfinite, loss_reduction)
    if isinstance(expected, str):
      assert np.all(np.isnan(updates["w"])), (cycle, updates)
    else:
      np.testing.assert_allclose(updates["w"], expected, rtol=1e-5,
                                 err_msg=str(cycle))
      assert bool(oa.has_updated(state)) == bool(np.any(expected != 0))
    cycle = []
  assert int(state.nonfinite_count) == dropped


def test_property_oracle_is_sensitive():
  """Negative controls: the oracle tells the failures the issue reported."""
  cycle = [(0, 2.0), (1, NAN), (2, 3.0)]
  # The old behaviour without skip_nonfinite: a NaN count emitted zeros.
  assert isinstance(_expected(cycle, False, "mean"), str)
  # A negative count used as a weight gives a finite, wrong mean.
  good = _expected([(0, 2.0), (2, 3.0)], False, "mean")
  used = _expected([(0, 2.0), (1, 1.0), (2, 3.0)], False, "mean")
  assert not np.allclose(good, used)


# --------------------------------------------------------------------------
# Gradient leaves: Python scalars, NumPy arrays, integers, complex numbers.


@pytest.mark.parametrize("jit", [False, True])
def test_python_scalar_and_numpy_gradient_leaves_work(jit):
  params = {"a": 0.0, "b": np.zeros(2, np.float32), "c": 0.0}
  tx = oa.accumulate(optax.sgd(1.0), 2)
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  _, state = update({"a": 1.0, "b": np.array([1.0, 2.0]), "c": 3}, state,
                    params, num_tokens=1)
  updates, state = update({"a": 2.0, "b": np.array([3.0, 0.0]), "c": 0},
                          state, params, num_tokens=1)
  helpers.assert_trees_equal(updates, {
      "a": jnp.float32(-1.5), "b": jnp.array([-2.0, -1.0]),
      "c": jnp.float32(-1.5),  # an integer gradient's mean is not rounded.
  })


def test_complex_gradients_need_complex_parameters():
  tx = oa.accumulate(optax.sgd(1.0), 2)
  with pytest.raises(TypeError, match=r"updates\['w'\] is complex"):
    jax.jit(tx.update)({"w": jnp.ones(3, jnp.complex64)},
                       tx.init(helpers.vector_params()))
  params = {"w": jnp.zeros(2, jnp.complex64)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([1 + 1j, 2j])}, state, num_tokens=1)
  updates, state = tx.update({"w": jnp.array([1 + 3j, 0j])}, state,
                             num_tokens=3)
  np.testing.assert_allclose(updates["w"], [-1 - 2.5j, -0.5j], rtol=1e-6)


# --------------------------------------------------------------------------
# Construction-time arguments.


@pytest.mark.parametrize("every_k", [2**31, np.int64(2**31), 2**64])
def test_every_k_outside_int32_refused_at_construction(every_k):
  with pytest.raises(ValueError, match=r"every_k must fit in int32.*got"):
    oa.accumulate(optax.sgd(1.0), every_k)


def test_largest_int32_every_k_is_accepted():
  tx = oa.accumulate(optax.sgd(1.0), 2**31 - 1, equal_weights=True)
  updates, state = tx.update(_grads(0), tx.init(helpers.vector_params()))
  assert int(state.micro_step) == 1 and not np.any(updates["w"])


def test_should_skip_must_be_callable():
  with pytest.raises(TypeError, match=r"should_skip must be None or callable"):
    oa.accumulate(optax.sgd(1.0), 2, should_skip=True)


# --------------------------------------------------------------------------
# update's keyword arguments: caught at trace time.


def test_unknown_keyword_refused_for_a_plain_inner():
  plain = optax.scale(-1.0)
  assert not isinstance(plain, optax.GradientTransformationExtraArgs)
  tx = oa.accumulate(plain, 2)
  with pytest.raises(TypeError, match=r"\['tokens_seen'\].*plain"):
    tx.update(_grads(0), tx.init(helpers.vector_params()), tokens_seen=3)
  tx.update(_grads(0), tx.init(helpers.vector_params()), num_tokens=3,
            emit=True)


@pytest.mark.parametrize("typo", ["num_token", "n_tokens", "numtokens",
                                  "emits"])
def test_typo_of_our_keywords_refused_whatever_inner(typo):
  tx = oa.accumulate(optax.adam(0.1), 2)  # adam takes extra arguments.
  with pytest.raises(TypeError, match=rf"'{typo}' to update: did you mean"):
    jax.jit(tx.update)(_grads(0), tx.init(helpers.vector_params()), **{typo: 3})


@pytest.mark.parametrize("emit", [
    1, "yes", jnp.array([True]), jnp.float32(1.0), jnp.int32(1)])
def test_emit_must_be_a_bool_scalar(emit):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  update = functools.partial(tx.update, _grads(0),
                             tx.init(helpers.vector_params()), emit=emit)
  with pytest.raises(TypeError, match=r"emit must be a bool scalar"):
    jax.jit(update)()
  if isinstance(emit, jax.Array):  # traced as well.
    with pytest.raises(TypeError, match=r"emit must be a bool scalar"):
      jax.jit(tx.update)(_grads(0), tx.init(helpers.vector_params()), emit=emit)


@pytest.mark.parametrize("returns", [
    optax.tree.norm, lambda g: g["w"] > 1, lambda g: 1,
    lambda g: None])
def test_should_skip_must_return_a_bool_scalar(returns):
  tx = oa.accumulate(optax.sgd(1.0), 2,
                     should_skip=lambda g, s, p: returns(g))
  with pytest.raises(TypeError,
                     match=r"should_skip\(grads, state, params\) must be a"
                     r" bool scalar"):
    jax.jit(tx.update).lower(_grads(0), tx.init(helpers.vector_params()))


# --------------------------------------------------------------------------
# Distributed mistakes: caught at trace time.

N, DIM = 8, 3


def _mesh():
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def _loss(params, x):
  return jnp.sum(params["w"] * x)  # params["unused"] takes no part.


def _shard_map_step(tx, local=True, emit=lambda x: None, flush=False):
  def step(params, state, x):
    if flush:  # zeros made from the replicated (invariant) params.
      grads, num_tokens = jax.tree.map(jnp.zeros_like, params), 0
    else:
      wrt = oa.device_local(params, "data") if local else params
      grads, num_tokens = jax.grad(_loss)(wrt, x[0]), 1.0
    updates, state = tx.update(grads, state, params, num_tokens=num_tokens,
                               emit=emit(x))
    return optax.apply_updates(params, updates), state

  return step


def _run_in_shard_map(step_kwargs, every_k=1, calls=1):
  tx = oa.accumulate(optax.sgd(1.0), every_k, axis_name="data")
  params = {"w": jnp.ones(DIM), "unused": jnp.ones(2)}
  with jax.set_mesh(_mesh()):
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    x = jax.device_put(jnp.arange(N * DIM, dtype=jnp.float32).reshape(N, DIM),
                       P("data"))
    for kwargs in [step_kwargs] * calls:
      step = jax.jit(jax.shard_map(_shard_map_step(tx, **kwargs),
                                   in_specs=(P(), specs, P("data")),
                                   out_specs=(P(), specs)))
      params, state = step(params, state, x)
  return params, state, x


def test_forgetting_device_local_is_caught_at_trace_time():
  with pytest.raises(ValueError, match=r"updates\['\w+'\] is the same on"
                     r" every device.*device_local"):
    _run_in_shard_map({"local": False})


def test_device_local_params_with_an_unused_one_are_fine():
  params, _, x = _run_in_shard_map({})
  np.testing.assert_allclose(params["w"], 1.0 - np.asarray(x).mean(0))
  np.testing.assert_array_equal(params["unused"], np.ones(2))


def test_emit_that_differs_between_devices_is_caught_at_trace_time():
  with pytest.raises(ValueError, match=r"emit varies over axis \['data'\]"):
    _run_in_shard_map({"emit": lambda x: x[0, 0] > 5})
  # The same decision taken from a psum is the same on every device.
  _run_in_shard_map({"emit": lambda x: jax.lax.psum(x[0, 0], "data") > 5})


def test_flush_with_zeros_of_replicated_params_in_shard_map():
  tx = oa.accumulate(optax.sgd(1.0), 4, axis_name="data")
  params = {"w": jnp.ones(DIM), "unused": jnp.ones(2)}
  with jax.set_mesh(_mesh()):
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    x = jax.device_put(jnp.arange(N * DIM, dtype=jnp.float32).reshape(N, DIM),
                       P("data"))
    steps = [jax.jit(jax.shard_map(_shard_map_step(tx, **kwargs),
                                   in_specs=(P(), specs, P("data")),
                                   out_specs=(P(), specs)))
             for kwargs in ({}, {"flush": True, "emit": lambda x: True})]
    params, state = steps[0](params, state, x)
    params, state = steps[1](params, state, x)
  assert bool(oa.has_updated(state))
  np.testing.assert_allclose(params["w"], 1.0 - np.asarray(x).mean(0))


def test_axis_name_outside_shard_map_under_a_mesh_is_caught():
  tx = oa.accumulate(optax.sgd(1.0), 2, axis_name="data")
  params = {"w": jnp.ones(DIM)}
  with jax.set_mesh(_mesh()):
    state = tx.init(params)  # one slot per device.
    for update in (tx.update, jax.jit(tx.update)):
      # Reduced gradients under a mesh: refused, naming shard_map (and the
      # unreduced gradients of gradient_sync='deferred').
      with pytest.raises(ValueError, match=r"axis_name='data'.*shard_map"):
        update(params, state, params)


def test_device_local_outside_a_manual_axis_is_named():
  with pytest.raises(ValueError, match=r"axis_name='data'\): 'data' is not a"
                     r" manual axis here.*jax\.shard_map"):
    oa.device_local({"w": jnp.ones(2)}, "data")
  with pytest.raises(TypeError, match="axis_name must be None, a str"):
    oa.device_local({"w": jnp.ones(2)}, 3)

