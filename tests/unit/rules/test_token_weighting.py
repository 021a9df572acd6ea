"""Both entry points follow one token-weighting rule, on the same hard data.

The data: four micro-batches of uneven token counts, one with no tokens at
all whose padded inputs are NaN (so its loss and gradient are NaN, for both
reductions). The full batch without that micro-batch is the reference.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K, ROWS, SEQ, DIM = 4, 2, 5, 3
LENGTHS = [5, 1, 0, 0, 2, 4, 3, 0]  # micro-batch 1 has no tokens.


def _data():
  batch = helpers.padded_batch(np.random.default_rng(0), LENGTHS, SEQ, DIM)
  # Padded positions of the empty micro-batch hold NaN, as garbage padding can.
  batch["x"][2:4] = np.nan
  return jax.tree.map(jnp.asarray, batch)


def _loss(loss_reduction):
  def loss_fn(params, batch):
    token_losses = helpers.linear_token_losses(params, batch)  # NaN * 0 = NaN
    if loss_reduction == "sum":
      return token_losses.sum()
    return helpers.raw_mean(token_losses, batch)

  return loss_fn


def _reference(loss_reduction):
  """The full batch's per-token mean gradient, without the empty rows."""
  batch = jax.tree.map(lambda x: np.delete(np.asarray(x), [2, 3], 0), _data())
  sum_grads = jax.grad(lambda p: helpers.linear_token_losses(p, batch).sum())(
      helpers.linear_params(DIM)
  )
  del loss_reduction  # the same objective, whatever each micro-batch returns.
  return jax.tree.map(lambda g: g / float(sum(LENGTHS)), sum_grads)


def _value_and_grad(loss_reduction, skip_nonfinite):
  del skip_nonfinite  # value_and_grad has no such option: it must not need it.
  fn = oa.value_and_grad(_loss(loss_reduction), num_microbatches=K,
                         num_tokens_fn=helpers.num_tokens,
                         loss_reduction=loss_reduction)
  return jax.jit(fn)(helpers.linear_params(DIM), _data())[1]


def _accumulate(loss_reduction, skip_nonfinite):
  params = helpers.linear_params(DIM)
  tx = oa.accumulate(optax.sgd(-1.0), every_k=K, loss_reduction=loss_reduction,
                     skip_nonfinite=skip_nonfinite)
  state = tx.init(params)
  step = jax.jit(lambda g, s, n: tx.update(g, s, params, num_tokens=n))
  for mb in helpers.split(_data(), K):
    grads = jax.grad(_loss(loss_reduction))(params, mb)
    updates, state = step(grads, state, helpers.num_tokens(mb))
  assert bool(oa.has_updated(state))
  return updates  # sgd(-1) hands back the mean gradient itself.


@pytest.mark.parametrize("entry_point", [_value_and_grad, _accumulate],
                         ids=["value_and_grad", "accumulate"])
@pytest.mark.parametrize("loss_reduction",
                         ["mean", pytest.param("sum", marks=pytest.mark.slow)])
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_entry_points_agree_on_zero_token_nan_micro_batches(
    entry_point, loss_reduction, skip_nonfinite):
  grads = entry_point(loss_reduction, skip_nonfinite)
  for leaf in jax.tree.leaves(grads):
    assert np.all(np.isfinite(leaf)), grads
  helpers.assert_trees_close(grads, _reference(loss_reduction), rtol=1e-5,
                             atol=1e-6)


def test_the_empty_micro_batch_is_really_nan():
  """Negative control: without the rule, the NaN would reach the sum."""
  empty = helpers.split(_data(), K)[1]
  for loss_reduction in ("mean", "sum"):
    grads = jax.grad(_loss(loss_reduction))(helpers.linear_params(DIM), empty)
    assert not np.all(np.isfinite(grads["w"]))


def _bad_count_data(bad):
  """The data above with micro-batch 2 claiming ``bad`` tokens."""
  batch = _data()
  batch["extra"] = jnp.zeros(len(LENGTHS)).at[4:6].set(bad)
  return batch


def _bad_num_tokens(mb):
  return helpers.num_tokens(mb) + mb["extra"][0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -100.0])
@pytest.mark.parametrize("loss_reduction",
                         ["mean", pytest.param("sum", marks=pytest.mark.slow)])
def test_entry_points_agree_on_a_bad_traced_token_count(bad, loss_reduction):
  """Neither uses it as a weight nor drops it silently: the mean is NaN."""
  data, params = _bad_count_data(bad), helpers.linear_params(DIM)
  fn = oa.value_and_grad(_loss(loss_reduction), num_microbatches=K,
                         num_tokens_fn=_bad_num_tokens,
                         loss_reduction=loss_reduction)
  _, from_value_and_grad = jax.jit(fn)(params, data)
  tx = oa.accumulate(optax.sgd(-1.0), every_k=K,
                     loss_reduction=loss_reduction)
  state, update = tx.init(params), jax.jit(tx.update)
  for mb in helpers.split(data, K):
    grads = jax.grad(_loss(loss_reduction))(params, mb)
    from_accumulate, state = update(grads, state, params,
                                    num_tokens=_bad_num_tokens(mb))
  for grads in (from_value_and_grad, from_accumulate):
    for leaf in jax.tree.leaves(grads):
      assert np.all(np.isnan(leaf)), grads


def test_entry_points_agree_on_a_concrete_bad_token_count():
  params, data = helpers.linear_params(DIM), _data()
  fn = oa.value_and_grad(_loss("mean"), num_microbatches=K,
                         num_tokens_fn=lambda mb: -1.0)
  with pytest.raises(ValueError, match=r"num_tokens.*finite number >= 0"):
    fn(params, data)
  tx = oa.accumulate(optax.sgd(1.0), every_k=K)
  with pytest.raises(ValueError, match=r"num_tokens.*finite number >= 0"):
    tx.update(params, tx.init(params), params, num_tokens=-1.0)


# --------------------------------------------------------------------------
# No token count: one per micro-batch, which warns once unless asked for.

_NO_COUNT = r"got no token counts, so every micro-batch counts as one token"


def _mean_loss(params, batch):
  return helpers.raw_mean(helpers.linear_token_losses(params, batch), batch)


def _no_count_runs():
  """Each entry point, built without a count and traced twice (jit, eager)."""
  params, batch = helpers.linear_params(DIM), _data()
  mbs = helpers.split(jax.tree.map(lambda x: x[4:], batch), 2)

  def accumulate(**kwargs):
    tx = oa.accumulate(optax.sgd(1.0), every_k=2, **kwargs)
    state = tx.init(params)
    for update in (jax.jit(tx.update), tx.update):
      for mb in mbs:
        _, state = update(jax.grad(_mean_loss)(params, mb), state, params)

  def value_and_grad(**kwargs):
    fn = oa.value_and_grad(_mean_loss, num_microbatches=2, **kwargs)
    for call in (jax.jit(fn), fn):
      call(params, jax.tree.map(lambda x: x[4:], batch))

  return {"num_tokens": accumulate, "num_tokens_fn": value_and_grad}


@pytest.mark.parametrize("entry_point", ["num_tokens", "num_tokens_fn"])
@pytest.mark.slow
def test_a_forgotten_token_count_warns_once_naming_the_fix(entry_point):
  run = _no_count_runs()[entry_point]
  with pytest.warns(UserWarning, match=_NO_COUNT) as record:
    run()
  assert len(record) == 1, [str(w.message) for w in record]
  message = str(record[0].message)
  assert f"Pass {entry_point}" in message and "equal_weights=True" in message
  # Said once, at construction: no warning at all.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    run(equal_weights=True)


def test_equal_weights_keeps_a_count_that_is_passed():
  params = helpers.linear_params(DIM)
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  state = tx.init(params)
  grads = [{"w": jnp.full((DIM,), g), "b": jnp.float32(g)} for g in (1., 4.)]
  for g, n in zip(grads, (3.0, 1.0)):
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      updates, state = tx.update(g, state, params, num_tokens=n)
  np.testing.assert_allclose(updates["b"], -(3 * 1 + 1 * 4) / 4)


def test_equal_weights_with_num_tokens_fn_is_refused():
  with pytest.raises(ValueError, match=r"equal_weights=True.*num_tokens_fn"):
    oa.value_and_grad(_mean_loss, num_microbatches=2, equal_weights=True,
                      num_tokens_fn=helpers.num_tokens)
  for entry_point in (
      lambda: oa.accumulate(optax.sgd(1.0), 2, equal_weights=1),
      lambda: oa.value_and_grad(_mean_loss, num_microbatches=2,
                                equal_weights="yes")):
    with pytest.raises(TypeError, match=r"equal_weights must be a bool"):
      entry_point()
