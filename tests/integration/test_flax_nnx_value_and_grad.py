"""The Flax NNX recipe for oa.value_and_grad (docs/flax.md), checked by hand.

A model with BatchNorm and Dropout is split into parameters and the rest of
its state (BatchNorm statistics, the Dropout's ``nnx.Rngs`` stream), the rest
is threaded through the micro-batches with ``has_state=True``, and each
micro-batch reseeds the dropout stream with the key ``rng=`` hands it.
"""

import contextlib

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import rng as rng_lib

K = 4


class Net(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(3, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.linear(x)))))


def _recipe():
  model = Net(nnx.Rngs(params=0, dropout=1))
  graphdef, _, _ = nnx.split(model, nnx.Param, ...)

  def nnx_loss(params, model_state, mb, *, rng):
    model = nnx.merge(graphdef, params, model_state, copy=True)
    nnx.reseed(model, dropout=rng)
    loss = jnp.mean((model(mb["x"]) - mb["y"]) ** 2)
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  return model, nnx_loss


def _batch_of(rows, seed=0):
  rng = np.random.default_rng(seed)
  return {"x": jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32)}


def _batch(seed=0):
  return _batch_of(32, seed)


def _by_hand(step, params, model_state, batch, keys):
  """The micro-batches one by one: the mean loss and gradient, final state."""
  losses, grads = [], []
  for mb, key in zip(helpers.split(batch, K), keys):
    (loss, model_state), g = step(params, model_state, mb, rng=key)
    losses.append(loss)
    grads.append(g)
  return np.mean(losses), jax.tree.map(lambda *g: sum(g) / K, *grads), \
      model_state


@pytest.mark.slow
def test_nnx_recipe_threads_state_and_draws_a_mask_per_micro_batch():
  model, nnx_loss = _recipe()
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  grad_fn = jax.jit(oa.value_and_grad(nnx_loss, num_microbatches=K,
                                      has_state=True, equal_weights=True))
  rng = jax.random.key(1)
  (loss, new_state), grads = grad_fn(params, model_state, _batch(), rng=rng)

  keys = [rng_lib.key_for(rng, i) for i in range(K)]
  step = jax.jit(jax.value_and_grad(nnx_loss, has_aux=True))
  expected_loss, expected_grads, expected_state = _by_hand(
      step, params, model_state, _batch(), keys)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-4, atol=1e-6)
  helpers.assert_trees_close(new_state["norm"], expected_state["norm"],
                             rtol=1e-5, atol=1e-6)
  assert not helpers.trees_close(new_state["norm"], model_state["norm"])

  # Negative control: one key for every micro-batch gives other masks.
  _, same_key_grads, _ = _by_hand(step, params, model_state, _batch(),
                                  [rng] * K)
  assert not helpers.trees_close(same_key_grads, expected_grads, rtol=1e-2)


@pytest.mark.parametrize("axis_name, mesh", [
    (None, False), (None, True), ("data", True)])
@pytest.mark.slow
def test_nnx_recipe_trains_with_nnx_optimizer(axis_name, mesh):
  """The recipe's train step; on 8 devices (an Auto mesh) too (issue 28)."""
  model, nnx_loss = _recipe()
  grad_fn = oa.value_and_grad(nnx_loss, num_microbatches=K, has_state=True,
                              equal_weights=True, axis_name=axis_name)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch, rng):
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    (loss, model_state), grads = grad_fn(params, model_state, batch, rng=rng)
    nnx.update(model, model_state)
    optimizer.update(model, grads)
    return loss

  before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
  with contextlib.ExitStack() as stack:
    if mesh:
      stack.enter_context(jax.set_mesh(jax.make_mesh(
          (8,), ("data",), axis_types=(AxisType.Auto,))))
    losses = [float(train_step(model, optimizer, _batch(),
                               jax.random.key(s))) for s in range(2)]
  assert np.all(np.isfinite(losses))
  assert int(optimizer.step[...]) == 2
  after = jax.tree.map(np.array, nnx.state(model, nnx.Param))
  assert not helpers.trees_close(after, before)


def _devices_by_hand(step, params, model_state, batch, rng, num_devices):
  """Each device's micro-batches one by one, with the keys it folds in.

  The mean loss and gradient over every device's micro-batches, and the
  model state after the loop: the BatchNorm statistics averaged over the
  devices, the rest (the Rngs counter) the first device's.
  """
  losses, grads, states = [], [], []
  for device, shard in enumerate(helpers.split(batch, num_devices)):
    keys = [rng_lib.key_for(jax.random.fold_in(rng, device), i)
            for i in range(K)]
    loss, g, state = _by_hand(step, params, model_state, shard, keys)
    losses.append(loss)
    grads.append(g)
    states.append(state)
  mean = lambda *xs: sum(xs) / len(xs)
  return np.mean(losses), jax.tree.map(mean, *grads), \
      jax.tree.map(mean, *[s["norm"] for s in states]), states[0]


def _recipe_on_mesh(axis_type, axis_name, batch, rng):
  """The recipe's value_and_grad under jit on 8 devices: its inputs, the
  one-device step to check it against, and what it returned."""
  model, nnx_loss = _recipe()
  _, params, model_state = nnx.split(model, nnx.Param, ...)
  grad_fn = jax.jit(oa.value_and_grad(
      nnx_loss, num_microbatches=K, has_state=True, equal_weights=True,
      axis_name=axis_name))
  with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=(axis_type,))):
    if axis_type == AxisType.Explicit:
      batch = jax.device_put(batch, jax.sharding.PartitionSpec("data"))
    out = grad_fn(params, model_state, batch, rng=rng)
  step = jax.jit(jax.value_and_grad(nnx_loss, has_aux=True))
  return params, model_state, step, out


def _assert_matches(out, expected_loss, expected_grads, expected_norm,
                    expected_state):
  (loss, new_state), grads = out
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-4, atol=1e-6)
  helpers.assert_trees_close(new_state["norm"], expected_norm,
                             rtol=1e-5, atol=1e-6)
  assert int(new_state["dropout"]["rngs"]["count"][...]) == int(
      expected_state["dropout"]["rngs"]["count"][...])


@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.slow
def test_nnx_recipe_on_an_auto_mesh(axis_name):
  """docs/flax.md's recipe under jit on 8 devices (issue 28).

  With ``axis_name`` the loss's new Rngs counter is invariant while the
  carried one is device-local: the scan refused the carry's type.
  """
  batch, rng = _batch_of(64), jax.random.key(1)
  params, model_state, step, out = _recipe_on_mesh(
      AxisType.Auto, axis_name, batch, rng)
  if axis_name is None:
    # Auto axes may shard the batch: micro-batch i holds rows i, i + K, ...
    strided = jax.tree.map(
        lambda x: x.reshape(-1, K, *x.shape[1:]).swapaxes(0, 1).reshape(
            x.shape), batch)
    keys = [rng_lib.key_for(rng, i) for i in range(K)]
    expected_loss, expected_grads, expected_state = _by_hand(
        step, params, model_state, strided, keys)
    expected_norm = expected_state["norm"]
  else:
    expected_loss, expected_grads, expected_norm, expected_state = (
        _devices_by_hand(step, params, model_state, batch, rng, 8))
  _assert_matches(out, expected_loss, expected_grads, expected_norm,
                  expected_state)


@pytest.mark.parametrize("axis_name", [None, "data"])
@pytest.mark.slow
def test_nnx_recipe_on_an_explicit_mesh(axis_name):
  """docs/flax.md's recipe in the typed form (Explicit axes under jit).

  loss_fn sees a global micro-batch, the i-th block of each device's rows,
  with the key fold_in(rng, i): the same as one device running those
  micro-batches, BatchNorm statistics and the Rngs counter included.
  """
  batch, rng = _batch_of(64), jax.random.key(1)
  params, model_state, step, out = _recipe_on_mesh(
      AxisType.Explicit, axis_name, batch, rng)
  blocked = jax.tree.map(
      lambda x: x.reshape(8, K, -1, *x.shape[1:]).swapaxes(0, 1).reshape(
          x.shape), batch)
  keys = [rng_lib.key_for(rng, i) for i in range(K)]
  expected_loss, expected_grads, expected_state = _by_hand(
      step, params, model_state, blocked, keys)
  _assert_matches(out, expected_loss, expected_grads, expected_state["norm"],
                  expected_state)
