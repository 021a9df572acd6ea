"""LoRA on a frozen base (docs/flax.md), in both entry points.

``nnx.LoRALinear`` keeps its base weights as ``nnx.Param`` and its adapters as
``nnx.LoRAParam`` (a subclass of ``nnx.Param``). ``oa.accumulate`` inside
``nnx.Optimizer(..., wrt=nnx.LoRAParam)``, and ``oa.value_and_grad`` over the
adapters split off the model (the base passed whole after the batch), each
take the full batch's step on the adapters, with uneven token counts, and
leave the base bit for bit as it was.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K = 4
ROWS = 8  # rows per micro-batch
# Real rows of each micro-batch, per cycle: very uneven token counts.
REAL_ROWS = [(1, 8, 3, 5), (6, 2, 8, 1)]


class _LoRANet(nnx.Module):
  """Two LoRALinear layers; the adapters' B starts non-zero, so that the
  first cycle moves both A and B."""

  def __init__(self, rngs):
    b_init = nnx.initializers.normal(0.1)
    self.hidden = nnx.LoRALinear(3, 8, lora_rank=2, b_initializer=b_init,
                                 rngs=rngs)
    self.out = nnx.LoRALinear(8, 2, lora_rank=2, b_initializer=b_init,
                              rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.tanh(self.hidden(x)))


def _loss(model, batch):
  err = batch["mask"][:, None] * (model(batch["x"]) - batch["y"]) ** 2
  return err.sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def _num_tokens(batch):
  return batch["mask"].sum()


def _batch(real_rows, seed):
  rng = np.random.default_rng(seed)
  rows = K * ROWS
  mask = np.concatenate([np.arange(ROWS) < n for n in real_rows])
  return {"x": jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32),
          "mask": jnp.asarray(mask, jnp.float32)}


def _tx():
  return optax.chain(optax.clip_by_global_norm(0.5),
                     optax.adamw(optax.linear_schedule(0.05, 0.01, 3),
                                 weight_decay=0.1))


def _lora(model):
  return nnx.state(model, nnx.LoRAParam)


def _base(model):
  return jax.tree.map(np.array, nnx.state(model, nnx.Not(nnx.LoRAParam)))


_LORA_GRAD = nnx.DiffState(0, nnx.LoRAParam)


@nnx.jit
def _full_step(model, optimizer, batch):
  grads = nnx.grad(_loss, argnums=_LORA_GRAD)(model, batch)
  optimizer.update(model, grads)


@pytest.mark.slow
def test_accumulate_in_an_nnx_optimizer_wrt_lora_params_is_the_full_batch():
  full_model, accum_model = _LoRANet(nnx.Rngs(0)), _LoRANet(nnx.Rngs(0))
  naive_model = _LoRANet(nnx.Rngs(0))
  base = _base(accum_model)
  full_opt = nnx.Optimizer(full_model, _tx(), wrt=nnx.LoRAParam)
  accum_opt = nnx.Optimizer(accum_model, oa.accumulate(_tx(), every_k=K),
                            wrt=nnx.LoRAParam)
  naive_opt = nnx.Optimizer(  # each micro-batch weighs the same.
      naive_model, oa.accumulate(_tx(), every_k=K, equal_weights=True),
      wrt=nnx.LoRAParam)
  # The optimizer state holds the adapters only: its sums have their size.
  lora_size = sum(x.size for x in jax.tree.leaves(_lora(accum_model)))
  grad_sum = oa.find_accumulate_state(accum_opt.opt_state).grad_sum
  assert sum(x.size for x in jax.tree.leaves(grad_sum)) == lora_size

  @nnx.jit
  def micro_step(model, optimizer, microbatch, num_tokens):
    grads = nnx.grad(_loss, argnums=_LORA_GRAD)(model, microbatch)
    optimizer.update(model, grads, num_tokens=num_tokens)

  before = jax.tree.map(np.array, _lora(accum_model))
  for cycle, real_rows in enumerate(REAL_ROWS):
    batch = _batch(real_rows, cycle)
    _full_step(full_model, full_opt, batch)
    for microbatch in helpers.split(batch, K):
      micro_step(accum_model, accum_opt, microbatch, _num_tokens(microbatch))
      micro_step(naive_model, naive_opt, microbatch, None)
    helpers.assert_trees_close(_lora(accum_model), _lora(full_model),
                               rtol=1e-5, atol=1e-6)

  assert int(oa.find_accumulate_state(accum_opt.opt_state).count) == 2
  assert not helpers.trees_close(_lora(accum_model), before, rtol=1e-3)
  helpers.assert_trees_equal(_base(accum_model), base)
  helpers.assert_trees_equal(_base(full_model), base)
  # Negative control: the mean of per-micro-batch means is another step.
  assert not helpers.trees_close(_lora(naive_model), _lora(full_model),
                                 rtol=1e-3)


@pytest.mark.slow
def test_value_and_grad_over_the_lora_params_is_the_full_batch():
  full_model, model = _LoRANet(nnx.Rngs(0)), _LoRANet(nnx.Rngs(0))
  base = _base(model)
  graphdef, _, _ = nnx.split(model, nnx.LoRAParam, ...)

  def lora_loss(lora_params, microbatch, frozen):
    return _loss(nnx.merge(graphdef, lora_params, frozen, copy=True),
                 microbatch)

  grad_fn = oa.value_and_grad(lora_loss, num_microbatches=K,
                              num_tokens_fn=_num_tokens)
  batch = _batch(REAL_ROWS[0], 0)

  # The loss and gradient: of the full batch, for the adapters only.
  _, lora_params, frozen = nnx.split(model, nnx.LoRAParam, ...)
  loss, grads = jax.jit(grad_fn)(lora_params, batch, frozen)
  full_loss, full_grads = nnx.value_and_grad(_loss, argnums=_LORA_GRAD)(
      full_model, batch)
  np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
  helpers.assert_trees_close(grads, full_grads, rtol=1e-5, atol=1e-7)
  assert jax.tree.structure(grads) == jax.tree.structure(lora_params)
  # Not vacuous: the mean of the micro-batches' means is another loss.
  means = [_loss(full_model, mb) for mb in helpers.split(batch, K)]
  assert abs(float(np.mean(means)) - float(full_loss)) > 1e-2 * full_loss

  # The train step of docs/flax.md against the full batch's.
  full_opt = nnx.Optimizer(full_model, _tx(), wrt=nnx.LoRAParam)
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.LoRAParam)

  @nnx.jit
  def train_step(model, optimizer, batch):
    _, lora_params, frozen = nnx.split(model, nnx.LoRAParam, ...)
    loss, grads = grad_fn(lora_params, batch, frozen)
    optimizer.update(model, grads)
    return loss

  for cycle, real_rows in enumerate(REAL_ROWS):
    batch = _batch(real_rows, cycle)
    _full_step(full_model, full_opt, batch)
    train_step(model, optimizer, batch)
  helpers.assert_trees_close(_lora(model), _lora(full_model),
                             rtol=1e-5, atol=1e-6)
  helpers.assert_trees_equal(_base(model), base)
