"""``oa.add_bias``, ``oa.multiply_scale`` and ``oa.reducible_layers``.

The helpers compute what ``x + bias`` and ``x * scale`` compute, on a batch
and on one example under ``jax.vmap``. The layers they build remove the
fallback of Flax NNX's and Equinox's ``Linear`` and ``LayerNorm`` (their
bias and scale reduced in every micro-batch): a model made of them has no
fallback leaf after ``oa.reducible_layers``, the same outputs, a gradient
exact against one device, and no gradient-sized all-reduce in the loop.
"""

import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa

ROWS, DIM, HIDDEN, OUT = 16, 4, 6, 3


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _batch():
  rng = np.random.default_rng(1)
  return {"x": jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(ROWS, OUT)), jnp.float32)}


@pytest.mark.parametrize("vmapped", [False, True])
def test_the_helpers_compute_the_plain_ops_and_their_gradients(vmapped):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(5, 2, 3)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(3,)), jnp.float32)

  def both(f, g):
    run = (lambda h: jax.vmap(h, in_axes=(0, None))) if vmapped else (
        lambda h: h)
    loss = lambda h: lambda x, v: jnp.sum(jnp.sin(run(h)(x, v)))
    return (run(f)(x, v), jax.grad(loss(f), (0, 1))(x, v)), (
        run(g)(x, v), jax.grad(loss(g), (0, 1))(x, v))

  for ours, plain in [both(oa.add_bias, lambda x, b: x + b),
                      both(oa.multiply_scale, lambda x, s: x * s)]:
    helpers.assert_trees_close(ours, plain, rtol=1e-5, atol=1e-6)


def test_add_bias_reads_no_value_of_x():
  out = oa.add_bias(jnp.array([jnp.inf, 1.0]), jnp.array([1.0, 2.0]))
  np.testing.assert_array_equal(out, [jnp.inf, 3.0])


@pytest.mark.parametrize("fn", [oa.add_bias, oa.multiply_scale])
@pytest.mark.parametrize("shape", [(4,), (3, 3), (2, 2, 3, 1)])
def test_a_factor_not_shaped_like_trailing_axes_is_named(fn, shape):
  name = "bias" if fn is oa.add_bias else "scale"
  message = (f"{name} of shape {shape} must be shaped like the trailing axes"
             " of x, of shape (2, 3)")
  with pytest.raises(ValueError, match=re.escape(message)):
    fn(jnp.ones((2, 3)), jnp.ones(shape))


def test_trailing_factors_of_any_rank_and_lists_work():
  x = np.arange(6.0).reshape(2, 3)
  np.testing.assert_array_equal(oa.add_bias(x, np.ones((2, 3))), x + 1)
  np.testing.assert_array_equal(oa.multiply_scale(x, 2.0), x * 2)
  np.testing.assert_array_equal(oa.add_bias([1.0, 2.0], [1.0, 1.0]),
                                [2.0, 3.0])


def test_a_pytree_without_layers_is_returned_as_it_is():
  tree = {"w": jnp.ones(3)}
  assert oa.reducible_layers(tree) is tree or oa.reducible_layers(
      tree) == tree


def _check(loss, params, swapped_loss, swapped_params):
  """The fallback before, none after; same values; exact; one reduction."""
  batch = _batch()
  leaves = jax.tree.leaves  # the swapped layers' classes differ.
  want = leaves(jax.value_and_grad(loss)(params, batch))
  helpers.assert_trees_close(
      leaves(jax.value_and_grad(swapped_loss)(swapped_params, batch)), want,
      rtol=1e-5, atol=1e-6)
  k = 2
  before = oa.value_and_grad(loss, num_microbatches=k, equal_weights=True)
  after = oa.value_and_grad(swapped_loss, num_microbatches=k,
                            equal_weights=True)
  with jax.set_mesh(_mesh()):
    sharded = jax.device_put(batch, P("data"))
    placed = jax.device_put(swapped_params, P())
    assert len(oa.sharding_report(before, params, sharded)
               .fallback_leaves) == 4
    assert oa.sharding_report(after, placed, sharded).fallback_leaves == ()
    step = jax.jit(after)
    got = step(placed, sharded)
    counts = oa.count_collectives(step.lower(placed, sharded).compile(),
                                  include_scalars=False)
  helpers.assert_trees_close(leaves(got), want, rtol=1e-5, atol=1e-6)
  assert counts.in_loop == {}, counts


@pytest.mark.slow
def test_flax_nnx_linear_and_layer_norm():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(DIM, HIDDEN, rngs=rngs)
      self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
      self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.norm(self.l1(x))))

  def split(model):
    graphdef, params = nnx.split(model, nnx.Param)
    return (lambda p, mb: jnp.mean(
        (nnx.merge(graphdef, p)(mb["x"]) - mb["y"]) ** 2)), params

  swapped = oa.reducible_layers(Model(nnx.Rngs(0)))
  assert isinstance(swapped.l1, nnx.Linear)
  assert type(swapped.norm) is not nnx.LayerNorm
  _check(*split(Model(nnx.Rngs(0))), *split(swapped))


@pytest.mark.slow
def test_equinox_linear_and_layer_norm():
  eqx = pytest.importorskip("equinox")

  class Model(eqx.Module):
    l1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.l1 = eqx.nn.Linear(DIM, HIDDEN, key=k1)
      self.norm = eqx.nn.LayerNorm(HIDDEN)
      self.l2 = eqx.nn.Linear(HIDDEN, OUT, key=k2)

    def __call__(self, x):
      return self.l2(jnp.tanh(self.norm(self.l1(x))))

  def split(model):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return (lambda p, mb: jnp.mean(
        (jax.vmap(eqx.combine(p, static))(mb["x"]) - mb["y"]) ** 2)), params

  model = Model(jax.random.key(0))
  swapped = oa.reducible_layers(model)
  assert isinstance(swapped.l1, eqx.nn.Linear) and swapped is not model
  assert type(model.l1) is eqx.nn.Linear  # the model given is unchanged.
  _check(*split(model), *split(swapped))
