"""The README's ``no_sync`` loop where users keep the optimizer state.

SPEC 8: one jit call per micro-batch, ``gradient_sync="deferred"`` and
``oa.accumulate`` without ``axis_name``, with the state held by an
``nnx.Optimizer`` on a model whose parameters are sharded
(``nnx.with_partitioning``-style metadata, Explicit 2 x 4 mesh), by a linen
``TrainState``, and as a plain optax state under ``jax.jit`` (that one in
``test_accumulate_typed.py``). Each is exact against the full batch and its
compiled non-emitting call reduces nothing gradient-sized.
"""

from flax import nnx
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

K = 4
ROWS, DIM, HIDDEN = 16, 3, 8


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)


def _batches(num=K, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    mask = (rng.random(ROWS) < 0.6).astype(np.float32)
    if i == 1:
      mask[:ROWS // 2] = 0  # the first data shard has no token here.
    out.append({
        "x": jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(ROWS,)), jnp.float32),
        "mask": jnp.asarray(mask),
    })
  return out


def _num_tokens(batch):
  return batch["mask"].sum()


def _apply(w1, w2, x):
  h = jnp.tanh(jnp.einsum("bd,dh->bh", x, w1, out_sharding=P("data", "model")))
  return jnp.einsum("bh,h->b", h, w2, out_sharding=P("data"))


def _loss_of(pred, batch):
  err = batch["mask"] * (pred - batch["y"]) ** 2
  return err.sum() / jnp.maximum(_num_tokens(batch), 1.0)


class _Mlp(nnx.Module):

  def __init__(self, rngs):
    init = nnx.initializers.normal(1.0)
    self.w1 = nnx.Param(nnx.with_partitioning(init, (None, "model"))(
        rngs.params(), (DIM, HIDDEN)))
    self.w2 = nnx.Param(nnx.with_partitioning(init, ("model",))(
        rngs.params(), (HIDDEN,)))

  def __call__(self, x):
    return _apply(self.w1[...], self.w2[...], x)


def _full_batch_sgd(params, batches, lr):
  """One SGD step on the whole batch, under the mesh (plain jax.grad)."""
  whole = jax.device_put(
      jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches), P("data"))
  grads = jax.grad(lambda p: _loss_of(_apply(p["w1"], p["w2"], whole["x"]),
                                      whole))(params)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def _gradient_reductions_outside_branch(compiled):
  """Reductions over "data" outside the emitting branch (the model's own
  collectives over "model", of activations, are the model's business)."""
  counts = oa.count_collectives(compiled, mesh=_mesh(), include_scalars=False)
  data = counts.by_axes.get(("data",))
  assert data is not None and data.in_branch, counts  # the one reduction.
  return data.outside


@pytest.mark.slow
def test_nnx_optimizer_on_a_sharded_model():
  batches = _batches()
  with jax.set_mesh(_mesh()):
    model = _Mlp(nnx.Rngs(0))
    before = {"w1": model.w1[...], "w2": model.w2[...]}
    optimizer = nnx.Optimizer(model, oa.accumulate(optax.sgd(0.5), every_k=K),
                              wrt=nnx.Param)
    grad_fn = oa.value_and_grad(
        lambda params, batch, graphdef: _loss_of(
            nnx.merge(graphdef, params)(batch["x"]), batch),
        num_microbatches=1, num_tokens_fn=_num_tokens,
        gradient_sync="deferred")

    @nnx.jit
    def micro_step(model, optimizer, batch):
      graphdef, params = nnx.split(model, nnx.Param)
      loss, grads = grad_fn(params, batch, graphdef)
      optimizer.update(model, grads, num_tokens=_num_tokens(batch))
      return loss

    sharded = [jax.device_put(b, P("data")) for b in batches]
    for b in sharded:
      micro_step(model, optimizer, b)
    after = {"w1": model.w1[...], "w2": model.w2[...]}
    assert after["w1"].sharding.spec == P(None, "model")
    # A non-emitting call, compiled: no gradient-sized reduction.
    lowered = nnx.jit(micro_step).lower(model, optimizer, sharded[0])
    assert _gradient_reductions_outside_branch(
        lowered.compile().as_text()) == {}
    expected = _full_batch_sgd(before, batches, 0.5)
  helpers.assert_trees_close(after, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_linen_train_state_holds_the_state():
  batches = _batches(seed=1)
  tx = oa.accumulate(optax.sgd(0.5), every_k=K)
  grad_fn = oa.value_and_grad(
      lambda params, batch: _loss_of(
          _apply(params["w1"], params["w2"], batch["x"]), batch),
      num_microbatches=1, num_tokens_fn=_num_tokens,
      gradient_sync="deferred")

  @jax.jit
  def micro_step(state, batch):
    loss, grads = grad_fn(state.params, batch)
    # TrainState.apply_gradients passes no keyword to tx.update: call it.
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params,
                                         num_tokens=_num_tokens(batch))
    return state.replace(
        step=state.step + oa.has_updated(opt_state).astype(jnp.int32),
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state), loss

  rng = np.random.default_rng(2)
  with jax.set_mesh(_mesh()):
    params = {
        "w1": jax.device_put(jnp.asarray(rng.normal(size=(DIM, HIDDEN)),
                                         jnp.float32), P(None, "model")),
        "w2": jax.device_put(jnp.asarray(rng.normal(size=(HIDDEN,)),
                                         jnp.float32), P("model")),
    }
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    sharded = [jax.device_put(b, P("data")) for b in batches]
    compiled = micro_step.lower(state, sharded[0]).compile()
    for b in sharded:
      state, _ = micro_step(state, b)
    assert int(state.step) == 1
    expected = _full_batch_sgd(params, batches, 0.5)
  assert _gradient_reductions_outside_branch(compiled) == {}
  helpers.assert_trees_close(state.params, expected, rtol=1e-5, atol=1e-6)
