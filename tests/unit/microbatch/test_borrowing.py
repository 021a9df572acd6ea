"""Unit tests of borrowing: an empty micro-batch's zeros without a select.

A micro-batch without tokens runs a kept one's data with a zero seed
(``optax_accum/_src/microbatch/borrowing.py``), so that every micro-batch's
gradient comes out weighted and finite; the sums must still be exactly the
full batch's, whichever micro-batches are empty.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.mesh import compat
from optax_accum._src.microbatch import borrowing
from optax_accum._src.rules import token_weighting
import ragged

DIM, VOCAB = ragged.DIM, ragged.VOCAB
# Borrowing is off before jax 0.10.2 (compat.while_loop_keeps_unreduced_sums):
# the tests of its program skip there; those of exactness run either way.
borrows = pytest.mark.skipif(
    not compat.while_loop_keeps_unreduced_sums(),
    reason="borrowing needs jax >= 0.10.2")


_batch, _params, mean_loss = ragged.batch, ragged.params, ragged.mean_loss
_token_losses = ragged.token_losses


# One jitted loop of 4 for the tests that need no other: compiled once per
# input type, not once per test.
_value_and_grad = jax.jit(oa.value_and_grad(
    mean_loss, num_microbatches=4, num_tokens_fn=helpers.num_tokens))


def _expected(params, batch):
  return jax.value_and_grad(mean_loss)(params, batch)


@pytest.mark.parametrize("lengths", [
    [0, 0, 3, 5, 1, 0, 2, 4],  # the first micro-batches empty: borrow later.
    [3, 5, 0, 0, 2, 4, 0, 0],  # empty in the middle and at the end.
    [0, 0, 0, 0, 0, 0, 0, 2],  # only the last has tokens.
])
def test_empty_micro_batches_add_nothing_with_an_embedding(lengths):
  loss, grads = _value_and_grad(_params(), _batch(lengths))
  expected_loss, expected_grads = _expected(_params(), _batch(lengths))
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-7)


def test_no_tokens_at_all_give_zeros_not_nan():
  loss, grads = _value_and_grad(_params(), _batch([0] * 8))
  assert float(loss) == 0.0
  helpers.assert_trees_equal(grads, jax.tree.map(jnp.zeros_like, _params()))


@pytest.mark.parametrize("bad", [-4.0, float("nan")])
@pytest.mark.parametrize("which", ["every", "one"])
def test_a_bad_count_makes_the_result_nan_not_zero(bad, which):
  """A NaN or negative count is never a weight, nor dropped silently: it
  reaches the token sum. With every count bad, the loop must still run (it
  ran none, as for no tokens at all, and gave a finite 0)."""
  def count(mb):
    n = helpers.num_tokens(mb)
    return jnp.where(n == 3.0, bad, n) if which == "one" else n * 0 + bad

  fn = jax.jit(oa.value_and_grad(mean_loss, num_microbatches=4,
                                 num_tokens_fn=count))
  loss, grads = fn(_params(), _batch([1, 2, 3, 0, 2, 2, 1, 1]))
  assert np.isnan(float(loss))
  assert all(bool(jnp.all(jnp.isnan(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("num_real", [1, 2, 3])
def test_only_real_micro_batches_are_borrowed(num_real):
  """Past ``num_real_microbatches`` nothing is run or borrowed: the sums
  are the real micro-batches' alone."""
  lengths = [0, 0, 3, 5, 1, 2, 4, 4]
  loss, grads = _value_and_grad(_params(), _batch(lengths),
                                num_real_microbatches=num_real)
  real = jax.tree.map(lambda x: x[:2 * num_real], _batch(lengths))
  if num_real == 1:  # no tokens in the real micro-batches at all.
    assert float(loss) == 0.0
    helpers.assert_trees_equal(grads, jax.tree.map(jnp.zeros_like, _params()))
    return
  expected_loss, expected_grads = _expected(_params(), real)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-7)


def test_a_bfloat16_loss_is_weighted_after_the_gradient():
  """A bfloat16 loss would round a count of 1234 to 1232 as the seed: its
  gradient is taken with a seed of one and multiplied in float32."""
  lengths = [0, 0, 3, 5, 1, 0, 2, 4]

  def bf16_loss(params, batch):
    return mean_loss(params, batch).astype(jnp.bfloat16)

  fn = jax.jit(oa.value_and_grad(bf16_loss, num_microbatches=4,
                                 num_tokens_fn=lambda mb: 617.0 * mb[
                                     "mask"].sum()))
  _, grads = fn(_params(), _batch(lengths))
  _, expected = _expected(_params(), _batch(lengths))
  helpers.assert_trees_close(grads, expected, rtol=2e-2, atol=1e-4)


def test_weighted_grads_seed_the_weight_or_multiply_by_it():
  c = token_weighting.contribution(jnp.float32(1234.0), "mean")
  f = lambda w: (w * 3.0) ** 2
  for dtype, weight in ((jnp.float32, 1.0), (jnp.bfloat16, 1234.0)):
    value, vjp_fn = jax.vjp(lambda w, d=dtype: f(w).astype(d), 2.0)
    grads, added = borrowing.weighted_grads(lambda ct, v=vjp_fn: v(ct), value,
                                            c)
    assert float(added.weight) == weight and added.keep is True
    np.testing.assert_allclose(float(grads) * weight, 1234.0 * 36.0,
                               rtol=1e-6)
  empty = token_weighting.contribution(jnp.float32(0.0), "mean")
  value, vjp_fn = jax.vjp(f, 2.0)
  grads, added = borrowing.weighted_grads(vjp_fn, value, empty)
  assert float(grads) == 0.0 and float(added.weight) == 1.0


@pytest.mark.parametrize("setting,applies", [
    ({}, True),
    ({"has_state": True}, False),
    ({"with_stats": True}, False),
    ({"has_aux": True}, False),  # stacked: each entry is its own.
    ({"has_aux": True, "aux_reductions": ["mean", "mean"]}, True),
    ({"has_aux": True, "aux_reductions": ["mean", "max"]}, False),
    ({"rules": ["mean", "last"]}, False),
    ({"params": {"w": jnp.zeros(2, jnp.float16)}}, False),
    ({"params": {"w": jnp.zeros(2, jnp.bfloat16)}}, True),
])
@borrows
def test_applies_only_where_no_micro_batch_output_is_its_own(setting,
                                                             applies):
  kwargs = dict(has_state=False, aux_reductions=None, has_aux=False,
                with_stats=False, rules=None, params=_params())
  assert borrowing.applies(**{**kwargs, **setting}) is applies


def test_float16_params_keep_the_select_and_stay_exact():
  params = jax.tree.map(lambda p: p.astype(jnp.float16), _params())
  lengths = [0, 0, 3, 5, 1, 0, 2, 4]
  _, grads = _value_and_grad(params, _batch(lengths))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  _, expected = _expected(f32, _batch(lengths))
  helpers.assert_trees_close(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), expected,
      rtol=1e-2, atol=1e-3)


def _selects_in_loops(jaxpr, looped=False):
  """The gradient-sized selects that ``jaxpr`` runs inside a loop."""
  found = []
  for eqn in jaxpr.eqns:
    inner = looped or eqn.primitive.name in ("scan", "while")
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          found += _selects_in_loops(sub, inner)
    if looped and eqn.primitive.name == "select_n" and (
        eqn.outvars[0].aval.shape == (VOCAB, DIM)):
      found.append(eqn)
  return found


def _gradient_sized_selects(fn, *args):
  return _selects_in_loops(jax.make_jaxpr(fn)(*args).jaxpr)


@borrows
def test_the_loop_adds_the_gradient_without_a_select():
  """The point of borrowing: nothing between XLA's scatter-add of the
  embedding gradient and the add into the sum. A stacked aux keeps the
  select (each micro-batch's aux is its own), the negative control."""
  batch = _batch([0, 0, 3, 5, 1, 0, 2, 4])
  fn = oa.value_and_grad(mean_loss, num_microbatches=4,
                         num_tokens_fn=helpers.num_tokens)
  assert not _gradient_sized_selects(fn, _params(), batch)
  with_aux = oa.value_and_grad(lambda p, b: (mean_loss(p, b), b["y"].sum()),
                               num_microbatches=4, has_aux=True,
                               num_tokens_fn=helpers.num_tokens)
  assert _gradient_sized_selects(with_aux, _params(), batch)


@pytest.mark.parametrize("lengths", [[0, 0, 3, 5, 1, 0, 2, 4], [0] * 8])
def test_the_loop_differentiates_like_the_full_batch(lengths):
  """The loop is a scan of every micro-batch; differentiated, a conditional
  around it that runs none when none has tokens: jax.grad of the loss is
  the full batch's gradient, and of a zero-token batch zero, not NaN.
  Before jax 0.10.2 it is the select's loop (empty_safe's derivative)."""
  fn = oa.value_and_grad(mean_loss, num_microbatches=4,
                         num_tokens_fn=helpers.num_tokens)
  batch = _batch(lengths)
  got = jax.grad(lambda p: fn(p, batch)[0])(_params())
  if not any(lengths):
    helpers.assert_trees_equal(got, jax.tree.map(jnp.zeros_like, _params()))
    return
  helpers.assert_trees_close(got, _expected(_params(), batch)[1], rtol=1e-5,
                             atol=1e-7)
  w_grad = jax.grad(lambda w: fn({**_params(), "w": w}, batch)[1]["w"].sum())
  full = jax.grad(lambda w: _expected({**_params(), "w": w}, batch)[1][
      "w"].sum())
  np.testing.assert_allclose(w_grad(_params()["w"]), full(_params()["w"]),
                             rtol=1e-4, atol=1e-6)


@borrows
@pytest.mark.parametrize("k", [1, 2])
def test_the_loop_is_a_scan_not_a_while_loop(k):
  """k = 1 has nothing to borrow, and XLA drops a scan of one trip; with
  k = 2 the borrowing loop is a scan too. A loop whose trips are counted at
  run time held 64 MiB more per TPU chip in benchmark k's deferred step, and
  20 MiB more (251.0 against 231.1 MiB, the hand-written scan's) on the
  16-layer decoder of benchmark q, data x tensor, TPU v5e."""
  fn = oa.value_and_grad(mean_loss, num_microbatches=k,
                         num_tokens_fn=helpers.num_tokens)
  jaxpr = str(jax.make_jaxpr(fn)(_params(), _batch([3, 0, 2, 1])))
  assert "while[" not in jaxpr and "scan[" in jaxpr and "cond[" not in jaxpr
