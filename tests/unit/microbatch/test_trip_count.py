"""``trip_count``: how many trips the micro-batch loop runs.

A scan of all ``k``; with a traced ``num_real_microbatches=n`` a while loop
of the first ``n``, the outputs of the others zeros; borrowing's loop, no
trip where the plan says none runs. The loop's results on real micro-batches
are checked through ``oa.value_and_grad`` in ``test_loop.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_accum._src.microbatch import trip_count

K = 4


def _step(carry, index):
  """Adds index + 1 to the carry; outputs (index * 10, index as a float)."""
  return carry + index + 1, (index * 10, index.astype(jnp.float32))


def test_without_n_every_micro_batch_runs_in_a_scan():
  carry, (tens, floats) = trip_count.run_microbatches(_step, jnp.int32(0), K,
                                                      None)
  assert int(carry) == 1 + 2 + 3 + 4
  np.testing.assert_array_equal(tens, [0, 10, 20, 30])
  np.testing.assert_array_equal(floats, [0.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("n", [1, 2, K])
def test_with_n_only_the_first_n_run_the_rest_output_zeros(n):
  run = jax.jit(lambda n: trip_count.run_microbatches(_step, jnp.int32(0), K,
                                                      n))
  carry, (tens, floats) = run(jnp.int32(n))
  assert int(carry) == sum(range(1, n + 1))
  np.testing.assert_array_equal(tens, [10 * i if i < n else 0
                                       for i in range(K)])
  assert floats.dtype == jnp.float32 and float(floats[n:].sum()) == 0.0


def test_a_traced_n_is_one_while_loop():
  jaxpr = jax.make_jaxpr(lambda n: trip_count.run_microbatches(
      _step, jnp.int32(0), K, n))(jnp.int32(2))
  assert [e.primitive.name for e in jaxpr.eqns].count("while") == 1
  jaxpr = jax.make_jaxpr(lambda: trip_count.run_microbatches(
      _step, jnp.int32(0), K, None))()
  assert "scan" in {e.primitive.name for e in jaxpr.eqns}


def _stacks_nothing(carry, index):
  return carry + index + 1, (index.astype(jnp.bfloat16), ())


@pytest.mark.parametrize("runs", [True, False])
def test_borrowing_runs_all_k_whatever_runs_says(runs):
  """A scan of all k (the caller zeroes the mean of no tokens);
  differentiated, none where ``runs`` fails (test_conditional_loops)."""
  carry, (values, stacked) = trip_count.run_borrowing(
      _stacks_nothing, jnp.int32(0), jnp.bool_(runs), K, None)
  assert int(carry) == 10
  # Nothing per micro-batch comes out: the values' dtype, read off the trace.
  assert values == jax.ShapeDtypeStruct((K,), jnp.bfloat16)
  assert stacked == ()


@pytest.mark.parametrize("runs, expected", [(True, 1 + 2), (False, 0)])
def test_borrowing_with_n_runs_the_first_n_or_none(runs, expected):
  carry, _ = trip_count.run_borrowing(
      _stacks_nothing, jnp.int32(0), jnp.bool_(runs), K, jnp.int32(2))
  assert int(carry) == expected


def test_borrowing_refuses_a_step_that_stacks_something():
  with pytest.raises(AssertionError, match="stacks nothing"):
    trip_count.run_borrowing(_step, jnp.int32(0), jnp.bool_(True), K, None)


def test_n_is_checked_concrete_and_clamped_traced():
  assert trip_count.check_num_real(None, K) is None
  assert int(trip_count.check_num_real(2, K)) == 2
  assert trip_count.check_num_real(np.int64(K), K).dtype == jnp.int32
  clamp = jax.jit(lambda n: trip_count.check_num_real(n, K))
  assert [int(clamp(jnp.int32(n))) for n in (0, 3, 9)] == [1, 3, K]


@pytest.mark.parametrize("n, error, match", [
    (0, ValueError, r"num_real_microbatches=0 must be in \[1,"),
    (K + 1, ValueError, r"num_microbatches=4\]"),
    (True, TypeError, "integer scalar"),
    (1.0, TypeError, "integer scalar"),
    (jnp.ones(2, jnp.int32), TypeError, "integer scalar"),
])
def test_a_bad_n_is_named(n, error, match):
  with pytest.raises(error, match=match):
    trip_count.check_num_real(n, K)


# The last micro-batch after the loop (SPEC 13): the same results.


def _last_step(carry):
  del carry
  return _step


def test_peeled_scan_gives_the_scans_results_its_last_trip_outside():
  carry, (tens, floats) = trip_count.run_microbatches(
      _step, jnp.int32(0), K, None, _last_step)
  assert int(carry) == 1 + 2 + 3 + 4
  np.testing.assert_array_equal(tens, [0, 10, 20, 30])
  np.testing.assert_array_equal(floats, [0.0, 1.0, 2.0, 3.0])
  jaxpr = jax.make_jaxpr(lambda: trip_count.run_microbatches(
      _step, jnp.int32(0), K, None, _last_step))()
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert scan.params["length"] == K - 1


@pytest.mark.parametrize("n", [1, 2, K])
def test_peeled_with_n_runs_the_nth_after_the_loop(n):
  run = jax.jit(lambda n: trip_count.run_microbatches(
      _step, jnp.int32(0), K, n, _last_step))
  carry, (tens, _) = run(jnp.int32(n))
  assert int(carry) == sum(range(1, n + 1))
  np.testing.assert_array_equal(tens, [10 * i if i < n else 0
                                       for i in range(K)])


@pytest.mark.parametrize("n", [None, 2])
def test_peeled_borrowing_runs_the_last_trip_whatever_runs_says(n):
  """Where no micro-batch has tokens the last trip runs all the same, after
  the loop: its sums (NaN, perhaps) are read as zeros after the reduction
  (token_weighting.mean), not selected here, before it."""
  nan_step = lambda carry, index: (
      carry + jnp.where(index == K - 1, jnp.nan, index + 1.0),
      (index.astype(jnp.bfloat16), ()))
  last = jax.jit(lambda runs: trip_count.run_borrowing(
      nan_step, jnp.float32(0), runs, K,
      None if n is None else jnp.int32(n), lambda carry: nan_step)[0])
  final = K if n is None else n
  expected = np.nan if final == K else sum(range(1, final + 1))
  np.testing.assert_array_equal(last(jnp.bool_(True)), expected)
  alone = np.nan if final == K else final  # the last trip's own.
  np.testing.assert_array_equal(last(jnp.bool_(False)), alone)


def test_the_last_micro_batch_leaves_the_loop_only_where_asked_and_useful():
  """Asked (overlap_reduction=True), with a reduction after the loop alone,
  and k > 1."""
  assert trip_count.peeled(True, 4, True)
  assert not trip_count.peeled(False, 4, True)
  assert not trip_count.peeled(True, 1, True)
  assert not trip_count.peeled(True, 4, False)
