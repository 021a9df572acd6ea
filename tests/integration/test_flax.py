"""Flax: nnx.Optimizer around oa.accumulate, linen BatchNorm state threaded."""

from typing import Any

from flax import linen as nn
from flax import nnx
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4
BATCH = 16


def _batch(seed=0):
  """A regression batch whose micro-batches hold 1, 4, 2 and 3 rows' tokens."""
  rng = np.random.default_rng(seed)
  mask = np.zeros((BATCH, 1), np.float32)
  for i, count in enumerate([1, 4, 2, 3]):
    mask[i * (BATCH // K) : i * (BATCH // K) + count] = 1.0
  return {
      "x": jnp.asarray(rng.normal(size=(BATCH, 3)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(BATCH, 2)), jnp.float32),
      "mask": jnp.asarray(mask),
  }


def _microbatches(batch):
  return helpers.split(batch, K)


class _Mlp(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.tanh(self.hidden(x)))


def _nnx_loss(model, batch):
  err = batch["mask"] * (model(batch["x"]) - batch["y"]) ** 2
  return err.sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def _tx():
  schedule = optax.linear_schedule(0.1, 0.01, 5)
  return optax.chain(
      optax.clip_by_global_norm(0.5),
      optax.adamw(schedule, weight_decay=0.1),
  )


def _params(model):
  return nnx.state(model, nnx.Param)


# Eager nnx.Optimizer updates are covered by the tests below.
_JITS = {
    "jit": nnx.jit,
    "jit_tree_mode": lambda f: nnx.jit(f, graph=False),
}


@pytest.mark.parametrize("jit", list(_JITS))
@pytest.mark.slow
def test_nnx_optimizer_k_micro_steps_equal_one_full_batch_step(jit):
  wrap = _JITS[jit]
  full_model, accum_model = _Mlp(nnx.Rngs(0)), _Mlp(nnx.Rngs(0))
  full_opt = nnx.Optimizer(full_model, _tx(), wrt=nnx.Param)
  accum_opt = nnx.Optimizer(
      accum_model, oa.accumulate(_tx(), every_k=K), wrt=nnx.Param)

  @wrap
  def full_step(model, optimizer, batch):
    grads = nnx.grad(_nnx_loss)(model, batch)
    optimizer.update(model, grads)

  @wrap
  def micro_step(model, optimizer, microbatch):
    grads = nnx.grad(_nnx_loss)(model, microbatch)
    optimizer.update(model, grads, num_tokens=microbatch["mask"].sum())
    return oa.has_updated(optimizer.opt_state)

  for cycle in range(3):
    batch = _batch(cycle)
    full_step(full_model, full_opt, batch)
    before = jax.tree.map(jnp.copy, _params(accum_model))
    emitted = [micro_step(accum_model, accum_opt, mb)
               for mb in _microbatches(batch)]
    assert [bool(e) for e in emitted] == [False] * (K - 1) + [True]
    # Parameters move only on the k-th micro-step of a cycle.
    assert not np.allclose(
        jax.tree.leaves(before)[0], jax.tree.leaves(_params(accum_model))[0])
    helpers.assert_trees_close(
        _params(accum_model), _params(full_model), rtol=1e-5, atol=1e-6)

  state = oa.find_accumulate_state(accum_opt.opt_state)
  assert int(state.count) == 3 and int(state.micro_step) == 0


@pytest.mark.slow
def test_nnx_mean_of_means_would_differ():
  """The test above is not vacuous: without num_tokens the result differs."""
  full_model, naive_model = _Mlp(nnx.Rngs(0)), _Mlp(nnx.Rngs(0))
  full_opt = nnx.Optimizer(full_model, _tx(), wrt=nnx.Param)
  naive_opt = nnx.Optimizer(  # without num_tokens: equal weights.
      naive_model, oa.accumulate(_tx(), every_k=K, equal_weights=True),
      wrt=nnx.Param)
  batch = _batch()
  full_opt.update(full_model, nnx.grad(_nnx_loss)(full_model, batch))
  for mb in _microbatches(batch):
    naive_opt.update(naive_model, nnx.grad(_nnx_loss)(naive_model, mb))
  assert not helpers.trees_close(
      _params(naive_model), _params(full_model), rtol=1e-3)


@pytest.mark.slow
def test_find_accumulate_state_on_nnx_optimizer_returns_plain_arrays():
  model = _Mlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, optax.chain(optax.scale(1.0), oa.accumulate(_tx(), every_k=2)),
      wrt=nnx.Param)
  for tree in (optimizer.opt_state, optimizer):
    state = oa.find_accumulate_state(tree)
    assert isinstance(state, oa.AccumulateState)
    for leaf in jax.tree.leaves(state):
      assert isinstance(leaf, jax.Array), type(leaf)
    assert isinstance(oa.has_updated(tree), jax.Array)
    assert not bool(oa.has_updated(tree))

  batch = _batch()
  flags = []
  for mb in _microbatches(batch):
    grads = nnx.grad(_nnx_loss)(model, mb)
    optimizer.update(model, grads, num_tokens=mb["mask"].sum())
    flags.append(bool(oa.has_updated(optimizer)))
  assert flags == [False, True, False, True]
  state = oa.find_accumulate_state(optimizer.opt_state)
  assert int(state.count) == 2
  assert state.token_count.dtype == jnp.float32
  # nnx.Optimizer's own step counts micro-steps; state.count, updates.
  assert int(optimizer.step[...]) == K


@pytest.mark.slow
def test_find_accumulate_state_inside_nnx_jit():
  model = _Mlp(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, oa.accumulate(_tx(), every_k=2), wrt=nnx.Param)

  @nnx.jit
  def micro_step(model, optimizer, mb):
    grads = nnx.grad(_nnx_loss)(model, mb)
    optimizer.update(model, grads, num_tokens=mb["mask"].sum())
    state = oa.find_accumulate_state(optimizer.opt_state)
    return state.micro_step, state.count

  steps = [tuple(int(v) for v in micro_step(model, optimizer, mb))
           for mb in _microbatches(_batch())]
  assert steps == [(1, 0), (0, 1), (1, 1), (0, 2)]


# ----------------------------------------------------------------------------
# Linen: TrainState with batch_stats threaded through oa.value_and_grad.
# ----------------------------------------------------------------------------


class _BnNet(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(2)(nn.relu(x))


class _TrainState(train_state.TrainState):
  batch_stats: Any


def _linen_loss(params, batch_stats, mb):
  preds, updates = _BnNet().apply(
      {"params": params, "batch_stats": batch_stats}, mb["x"], train=True,
      mutable=["batch_stats"])
  err = mb["mask"] * (preds - mb["y"]) ** 2
  loss = err.sum() / jnp.maximum(mb["mask"].sum(), 1.0)
  return loss, updates["batch_stats"]


def _linen_state():
  variables = _BnNet().init(jax.random.key(0), jnp.zeros((1, 3)), train=False)
  return _TrainState.create(
      apply_fn=_BnNet().apply, params=variables["params"],
      batch_stats=variables["batch_stats"], tx=_tx())


@pytest.mark.slow
def test_linen_batch_stats_are_threaded_micro_batch_by_micro_batch():
  state = _linen_state()
  batch = _batch()
  fn = jax.jit(oa.value_and_grad(
      _linen_loss, num_microbatches=K, has_state=True,
      num_tokens_fn=lambda mb: mb["mask"].sum()))
  (loss, batch_stats), grads = fn(state.params, state.batch_stats, batch)

  # The same, one micro-batch after the other, in Python.
  stats, loss_sum, grad_sum, tokens = state.batch_stats, 0.0, None, 0.0
  for mb in _microbatches(batch):
    (mb_loss, stats), mb_grads = jax.value_and_grad(
        _linen_loss, has_aux=True)(state.params, stats, mb)
    n = mb["mask"].sum()
    loss_sum += n * mb_loss
    tokens += n
    weighted = jax.tree.map(lambda g, n=n: n * g, mb_grads)
    grad_sum = weighted if grad_sum is None else jax.tree.map(
        jnp.add, grad_sum, weighted)

  helpers.assert_trees_close(batch_stats, stats, rtol=1e-5, atol=1e-6)
  helpers.assert_trees_close(loss, loss_sum / tokens, rtol=1e-5)
  helpers.assert_trees_close(
      grads, jax.tree.map(lambda g: g / tokens, grad_sum), rtol=1e-5,
      atol=1e-6)
  # k momentum updates, not one: the statistics moved further than a single
  # full-batch update would have moved them.
  assert not np.allclose(batch_stats["BatchNorm_0"]["mean"],
                         state.batch_stats["BatchNorm_0"]["mean"])


@pytest.mark.slow
def test_linen_train_state_recipe():
  grad_fn = oa.value_and_grad(
      _linen_loss, num_microbatches=K, has_state=True,
      num_tokens_fn=lambda mb: mb["mask"].sum())

  @jax.jit
  def train_step(state, batch):
    (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats,
                                         batch)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss

  state = _linen_state()
  losses = []
  for step in range(20):
    state, loss = train_step(state, _batch(step % 2))
    losses.append(float(loss))
  assert int(state.step) == 20
  assert losses[-1] < losses[0]
  # Evaluation uses the threaded running averages.
  preds = state.apply_fn(
      {"params": state.params, "batch_stats": state.batch_stats},
      _batch()["x"], train=False)
  assert bool(jnp.all(jnp.isfinite(preds)))
