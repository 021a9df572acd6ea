"""Unit tests of oa.value_and_grad: exactness, aux, args, state, dtypes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import optax_accum as oa

BATCH, SEQ, DIM = 8, 6, 4


def _data(seed=0):
  lengths = [6, 1, 0, 2, 6, 5, 1, 3]  # uneven across micro-batches
  batch = helpers.padded_batch(np.random.default_rng(seed), lengths, SEQ, DIM)
  assert len(lengths) == BATCH
  return jax.tree.map(jnp.asarray, batch)


def _params():
  return helpers.linear_params(DIM)


_token_losses = helpers.linear_token_losses
num_tokens = helpers.num_tokens


def mean_loss(params, batch):  # 0/0 without tokens, on purpose.
  return helpers.raw_mean(_token_losses(params, batch), batch)


def sum_loss(params, batch):
  return _token_losses(params, batch).sum()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_matches_full_batch_with_uneven_tokens(k, loss_reduction):
  loss_fn = mean_loss if loss_reduction == "mean" else sum_loss
  fn = jax.jit(oa.value_and_grad(
      loss_fn, num_microbatches=k, num_tokens_fn=num_tokens,
      loss_reduction=loss_reduction))
  loss, grads = fn(_params(), _data())
  expected_loss, expected_grads = jax.value_and_grad(mean_loss)(
      _params(), _data())
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def test_mean_of_means_differs_on_the_same_data():
  fn = oa.value_and_grad(mean_loss, num_microbatches=4, equal_weights=True)
  loss, _ = fn(_params(), _data())
  expected = mean_loss(_params(), _data())
  assert abs(float(loss) - float(expected)) > 1e-3


def test_without_num_tokens_each_micro_batch_weighs_the_same():
  data = _data()

  def mse(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

  loss, grads = oa.value_and_grad(mse, num_microbatches=4,
                                  equal_weights=True)(_params(), data)
  expected_loss, expected_grads = jax.value_and_grad(mse)(_params(), data)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def test_aux_is_stacked_per_micro_batch_in_order():
  def loss_fn(params, batch):
    return mean_loss(params, batch), {"tokens": num_tokens(batch),
                                      "first": batch["y"][0, 0]}

  fn = oa.value_and_grad(loss_fn, num_microbatches=4, has_aux=True,
                         num_tokens_fn=num_tokens)
  (loss, aux), _ = fn(_params(), _data())
  np.testing.assert_allclose(loss, mean_loss(_params(), _data()), rtol=1e-5)
  np.testing.assert_array_equal(aux["tokens"], [7.0, 2.0, 11.0, 4.0])
  np.testing.assert_array_equal(aux["first"], _data()["y"][::2, 0])


def test_extra_args_are_passed_through_unsplit():
  def loss_fn(params, batch, scale, offset):
    return scale * mean_loss(params, batch) + offset

  fn = oa.value_and_grad(loss_fn, num_microbatches=2, num_tokens_fn=num_tokens)
  loss, grads = fn(_params(), _data(), jnp.float32(3.0), jnp.float32(1.0))
  expected_loss, expected_grads = jax.value_and_grad(loss_fn)(
      _params(), _data(), 3.0, 1.0)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def _bn_loss(params, stats, batch):
  """A BatchNorm-like layer: normalise with the micro-batch's statistics."""
  h = batch["x"][:, 0, :] * params["w"]
  mean = h.mean(axis=0)
  new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean,
               "steps": stats["steps"] + 1}
  loss = jnp.mean((h - mean) ** 2) + params["b"] ** 2
  return loss, new_stats


@pytest.mark.parametrize("has_aux", [False, True])
def test_model_state_is_threaded_through_micro_batches(has_aux):
  stats = {"mean": jnp.zeros(DIM), "steps": jnp.int32(0)}
  data = _data()

  def loss_fn(params, stats, batch):
    loss, new_stats = _bn_loss(params, stats, batch)
    return (loss, (new_stats, loss)) if has_aux else (loss, new_stats)

  fn = jax.jit(oa.value_and_grad(
      loss_fn, num_microbatches=4, has_state=True, has_aux=has_aux,
      equal_weights=True))
  (loss, rest), grads = fn(_params(), stats, data)
  final_stats, aux = rest if has_aux else (rest, None)

  expected_stats, losses, grad_list = stats, [], []
  for mb in helpers.split(data, 4):
    (mb_loss, expected_stats), g = jax.value_and_grad(
        _bn_loss, has_aux=True)(_params(), expected_stats, mb)
    losses.append(mb_loss)
    grad_list.append(g)
  helpers.assert_trees_close(final_stats, expected_stats, rtol=1e-5,
                             atol=1e-6)
  assert int(final_stats["steps"]) == 4
  np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-5)
  helpers.assert_trees_close(
      grads, jax.tree.map(lambda *g: sum(g) / 4, *grad_list), rtol=1e-5,
      atol=1e-6)
  if has_aux:
    np.testing.assert_allclose(aux, losses, rtol=1e-6)


def test_zero_tokens_give_zero_loss_and_gradient_not_nan():
  data = _data()
  data["mask"] = jnp.zeros_like(data["mask"])
  loss, grads = oa.value_and_grad(
      mean_loss, num_microbatches=2, num_tokens_fn=num_tokens)(_params(), data)
  assert float(loss) == 0.0
  helpers.assert_trees_equal(grads, jax.tree.map(jnp.zeros_like, _params()))


def test_micro_batch_without_tokens_does_not_poison_the_sum():
  data = _data()
  data["mask"] = data["mask"].at[4:6].set(0.0)  # micro-batch 2 of 4 is empty
  fn = oa.value_and_grad(mean_loss, num_microbatches=4,
                         num_tokens_fn=num_tokens)
  loss, grads = fn(_params(), data)  # mean_loss of that micro-batch is 0/0
  expected_loss, expected_grads = jax.value_and_grad(mean_loss)(
      _params(), data)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_params_sum_in_float32_and_return_bf16_like_loss_fn():
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
  data = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _data())
  with jax.numpy_dtype_promotion("strict"):
    loss, grads = jax.jit(oa.value_and_grad(
        mean_loss, num_microbatches=4, num_tokens_fn=num_tokens))(params, data)
  assert loss.dtype == jnp.bfloat16  # loss_fn's dtype, as jax.value_and_grad
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  f32 = jax.tree.map(lambda x: x.astype(jnp.float32), (params, data))
  expected = jax.grad(mean_loss)(*f32)
  helpers.assert_trees_close(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), expected,
      rtol=3e-2, atol=1e-2)


def _opcodes(hlo_text):
  pattern = re.compile(r"^\s*(?:ROOT\s+)?%\S+ = \S+ ([\w-]+)\(", re.M)
  return [(m.group(1), m.group(0)) for m in pattern.finditer(hlo_text)]


def test_split_is_a_reshape_not_a_copy():
  fn = oa.value_and_grad(mean_loss, num_microbatches=4,
                         num_tokens_fn=num_tokens)
  hlo = jax.jit(fn).lower(_params(), _data()).compile().as_text()
  ops = _opcodes(hlo)
  # Each micro-batch is sliced out of the (bitcast) batch inside the loop: no
  # transpose, gather or copy of a batch-sized array.
  assert not [line for op, line in ops if op in ("transpose", "gather")]
  assert not [line for op, line in ops
              if op == "copy" and ("[8,6" in line or "[4,2,6" in line)]
  assert any(op == "dynamic-slice" and "[1,2,6,4]" in line for op, line in ops)


def test_no_retracing_across_calls():
  traces = []

  def loss_fn(params, batch):
    traces.append(1)
    return mean_loss(params, batch)

  fn = jax.jit(oa.value_and_grad(loss_fn, num_microbatches=2,
                                 num_tokens_fn=num_tokens))
  for seed in range(3):
    fn(_params(), _data(seed))
  assert len(traces) == 1
