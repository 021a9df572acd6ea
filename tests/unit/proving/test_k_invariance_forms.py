"""oa.check_k_invariance on the forms users train in: an nnx.Optimizer, a
linen TrainState, a mesh with Explicit axes (ZeRO-1 too), and pmap, where
a reduction missing or done twice must be reported."""

from flax import nnx
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

DEVICES = 8


@pytest.fixture(name="batch")
def _batch():
  """16 rows of uneven lengths: 2 per device, micro-batches of unequal
  token counts."""
  rng = np.random.default_rng(3)
  lengths = rng.integers(1, 7, size=16)
  lengths[:4] = 1
  return jax.tree.map(jnp.asarray, helpers.padded_batch(rng, lengths, 6, 3))


def _loss(model, mb):
  losses = mb["mask"] * (model(mb["x"])[..., 0] - mb["y"]) ** 2
  return helpers.safe_mean(losses, mb)


def test_an_nnx_optimizer_per_call_step_passes(batch):
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

  def make_step(k):
    @nnx.jit
    def micro_step(model, optimizer, mb):
      grads = nnx.grad(_loss)(model, mb)
      optimizer.update(model, grads, num_tokens=mb["mask"].sum())

    def step(state, batch):
      model, _ = state
      optimizer = nnx.Optimizer(
          model, oa.accumulate(optax.adamw(1e-2), every_k=k), wrt=nnx.Param)
      for mb in helpers.split(batch, k):
        micro_step(model, optimizer, mb)
      return model, optimizer.opt_state

    return step

  start = nnx.Optimizer(model, oa.accumulate(optax.adamw(1e-2), every_k=1),
                        wrt=nnx.Param).opt_state
  before = np.asarray(model.kernel[...])
  report = oa.check_k_invariance(make_step, (model, start), batch)
  assert report.ok, report
  np.testing.assert_array_equal(model.kernel[...], before)  # not changed.


def test_an_nnx_optimizer_in_the_state_passes(batch):
  # The optimizer itself in the state: its step counts micro-steps, listed.
  @nnx.jit
  def micro_step(model, optimizer, mb):
    optimizer.update(model, nnx.grad(_loss)(model, mb),
                     num_tokens=mb["mask"].sum())

  make_step = helpers.optimizer_k_step(micro_step)
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, oa.accumulate(optax.adamw(1e-2), every_k=1),
                            wrt=nnx.Param)
  report = oa.check_k_invariance(make_step, (model, optimizer), batch)
  assert report.ok, report
  assert "[1].step" in dict(report.ignored)


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(jnp.tanh(nn.Dense(4)(x)))


def test_a_linen_train_state_with_the_one_call_loop_passes(batch):
  module = _Mlp()
  params = module.init(jax.random.key(0), batch["x"])["params"]
  state = train_state.TrainState.create(
      apply_fn=module.apply, params=params,
      tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))

  def make_step(k):
    def loss_fn(params, mb):
      return _loss(lambda x: state.apply_fn({"params": params}, x), mb)

    grad_fn = oa.value_and_grad(loss_fn, num_microbatches=k,
                                num_tokens_fn=helpers.num_tokens)

    @jax.jit
    def step(state, batch):
      _, grads = grad_fn(state.params, batch)
      return state.apply_gradients(grads=grads)

    return step

  report = oa.check_k_invariance(make_step, state, batch)
  assert report.ok, report


def _typed_step(k, tx_factory, grad_kwargs=None):
  """The README's deferred per-call step on a mesh with Explicit axes."""
  tx = tx_factory(k)
  grad_fn = oa.value_and_grad(
      helpers.mlp_mean_loss, num_microbatches=1,
      num_tokens_fn=helpers.num_tokens, gradient_sync="deferred",
      **(grad_kwargs or {}))

  @jax.jit
  def micro_step(params, opt_state, mb):
    _, grads = grad_fn(params, mb)
    return oa.update_and_apply(tx, grads, opt_state, params,
                               num_tokens=helpers.num_tokens(mb))

  def step(state, batch):
    params, opt_state = state
    for mb in helpers.split(batch, k):
      params, opt_state = micro_step(params, opt_state,
                                     jax.device_put(mb, P("data")))
    return params, opt_state

  return step


# ZeRO-1 ("data") runs the deferred step and its sharded state; the plain
# deferred step (None, 6 s on 2 cores) adds only the replicated state.
@pytest.mark.parametrize("shard_optimizer", [
    pytest.param(None, marks=pytest.mark.slow), "data"])
def test_a_deferred_step_on_a_mesh_passes_zero_too(batch, shard_optimizer):
  mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(AxisType.Explicit,))
  tx_factory = lambda k: oa.accumulate(optax.adamw(1e-2), every_k=k,
                                       shard_optimizer=shard_optimizer)
  with jax.set_mesh(mesh):
    params = helpers.mlp_params(3, 8, seed=0)
    state = (params, jax.jit(tx_factory(1).init)(params))
    report = oa.check_k_invariance(
        lambda k: _typed_step(k, tx_factory), state, batch,
        num_microbatches=(1, 2))
  assert report.ok, report
  assert set(report.replicas) == {1, 2}
  assert all(r.ok and r.checked > 0 for r in report.replicas.values())


# pmap: the reduction missing, or done twice.


def _pmap_step(k, axis_name, pmean):
  tx = oa.accumulate(optax.sgd(0.5), every_k=k, axis_name=axis_name)

  def micro_step(params, opt_state, mb):
    grads = jax.grad(helpers.mlp_mean_loss)(params, mb)
    if pmean:
      grads = jax.lax.pmean(grads, "batch")
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=helpers.num_tokens(mb))
    return optax.apply_updates(params, updates), opt_state

  p_step = jax.pmap(micro_step, axis_name="batch")

  def step(state, batch):
    params, opt_state = state
    per_device = jax.tree.map(
        lambda x: x.reshape((DEVICES, -1) + x.shape[1:]), batch)
    for i in range(k):  # micro-batch i: rows i, i + k, ... of each device.
      params, opt_state = p_step(
          params, opt_state, jax.tree.map(lambda x, i=i: x[:, i::k],
                                          per_device))
    return params, opt_state

  return step


def _pmap_state(axis_name):
  params = helpers.mlp_params(3, 8, seed=0)
  opt_state = oa.accumulate(optax.sgd(0.5), every_k=1,
                            axis_name=axis_name).init(params)
  return jax.pmap(lambda x: x, axis_name="batch")(jax.tree.map(
      lambda x: jnp.stack([x] * DEVICES), (params, opt_state)))


def test_pmap_with_axis_name_passes(batch):
  report = oa.check_k_invariance(
      lambda k: _pmap_step(k, "batch", pmean=False), _pmap_state("batch"),
      batch, num_microbatches=(1, 2))
  assert report.ok, report
  assert report.replicas[2].ok and report.replicas[2].checked > 0


def test_pmap_without_a_reduction_is_reported(batch):
  report = oa.check_k_invariance(
      lambda k: _pmap_step(k, None, pmean=False), _pmap_state(None), batch,
      num_microbatches=(1, 2))
  assert not report.ok
  assert not report.replicas[1].ok
  assert "not reduced over them" in report.hint, report.hint


def test_pmap_reducing_twice_is_reported(batch):
  # lax.pmean of the gradient and accumulate's axis_name: a mean of the
  # devices' means, whatever their token counts.
  report = oa.check_k_invariance(
      lambda k: _pmap_step(k, "batch", pmean=True), _pmap_state("batch"),
      batch, num_microbatches=(1, 2))
  assert not report.ok
  assert "lax.pmean" in report.hint, report.hint


class _Attention(nnx.Module):
  """Embedding, causal self-attention (biased keys: a true gradient of
  zero) and layers scanned over a stacked weight, as decoders are written."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(50, 16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16,
                                       decode=False, rngs=rngs)
    self.layers = nnx.Param(
        jax.random.normal(jax.random.key(1), (3, 16, 16)) * 0.1)
    self.out = nnx.Linear(16, 50, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    h = h + self.attn(h, mask=nnx.make_causal_mask(tokens))
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h,
                        self.layers[...])
    return self.out(h)


@pytest.mark.slow  # compiles an attention decoder per split (~20 s).
@pytest.mark.parametrize("equal_weights", [False, True])
def test_an_adam_decoder_with_scanned_layers(equal_weights):
  rng = np.random.default_rng(0)
  lengths = np.array([1, 2, 12, 11, 3, 2, 10, 12])
  mask = (np.arange(12)[None] < lengths[:, None]).astype(np.float32)
  batch = {"x": jnp.asarray(rng.integers(0, 50, (8, 12))),
           "y": jnp.asarray(rng.integers(0, 50, (8, 12))),
           "mask": jnp.asarray(mask)}
  graphdef, params = nnx.split(_Attention(nnx.Rngs(0)))
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(1e-3, weight_decay=0.1))

  def loss_fn(params, mb):
    logits = nnx.merge(graphdef, params)(mb["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
    return (losses * mb["mask"]).sum() / jnp.maximum(mb["mask"].sum(), 1)

  def make_step(k):
    grad_fn = oa.value_and_grad(
        loss_fn, num_microbatches=k, equal_weights=equal_weights,
        num_tokens_fn=None if equal_weights else helpers.num_tokens)

    @jax.jit
    def step(state, batch):
      params, opt_state = state
      _, grads = grad_fn(params, batch)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return step

  report = oa.check_k_invariance(make_step, (params, opt.init(params)), batch)
  if equal_weights:  # a mean of micro-batch means: reported.
    assert not report.ok
    assert "weighted by something other" in report.hint
  else:
    # The keys' biases differ by Adam-scaled rounding noise, and pass.
    assert report.ok, report
    noise = [row.path for row in report.leaves if row.zero_gradient]
    assert noise and all("['key']['bias']" in path for path in noise), noise
    assert "rounding noise" in str(report)
