"""The micro-batch loop's trip count: ``num_real_microbatches=n``.

Compared against the same call on only the first ``n`` micro-batches' rows
(which the first ``n`` iterations must reproduce exactly, keys, aux and
model state included) and against ``jax.grad`` on those rows.
"""

import chex
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa

K, ROWS, SEQ, DIM = 4, 4, 3, 2  # ROWS rows per micro-batch.


def _params():
  return helpers.linear_params(DIM)


def _batch(rows=K * ROWS, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, SEQ + 1, size=rows)
  return jax.tree.map(jnp.asarray,
                      helpers.padded_batch(rng, lengths, SEQ, DIM))


def _first(batch, n):
  return jax.tree.map(lambda x: x[:n * ROWS], batch)


def loss_fn(params, state, batch, *, rng):
  """A mean loss with dropout, a running state and per-micro-batch aux."""
  keep = jax.random.bernoulli(rng, 0.7, batch["x"].shape)
  x = jnp.where(keep, batch["x"] / 0.7, 0.0)
  token_losses = helpers.linear_token_losses(params, {**batch, "x": x})
  loss = helpers.safe_mean(token_losses, batch)
  return loss, (state + helpers.num_tokens(batch), {"loss": loss})


def _fn(num_microbatches=K, **kwargs):
  return oa.value_and_grad(
      loss_fn, num_microbatches=num_microbatches, has_aux=True,
      has_state=True, num_tokens_fn=helpers.num_tokens, **kwargs)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.slow
def test_the_first_n_micro_batches_exactly(n):
  key, batch = jax.random.key(7), _batch()
  fn = jax.jit(_fn(), static_argnames=())
  ((loss, (state, aux)), grads) = fn(_params(), jnp.float32(0.0), batch,
                                     rng=key, num_real_microbatches=n)
  ((exp_loss, (exp_state, exp_aux)), exp_grads) = jax.jit(_fn(n))(
      _params(), jnp.float32(0.0), _first(batch, n), rng=key)
  helpers.assert_trees_equal((loss, state, grads), (exp_loss, exp_state,
                                                     exp_grads))
  helpers.assert_trees_equal(aux["loss"][:n], exp_aux["loss"])
  helpers.assert_trees_equal(aux["loss"][n:], jnp.zeros(K - n))
  assert state == helpers.num_tokens(_first(batch, n))


@pytest.mark.slow
def test_a_traced_n_does_not_recompile_and_is_clamped():
  fn = _fn()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, batch, n):
    return fn(params, jnp.float32(0.0), batch, rng=jax.random.key(0),
              num_real_microbatches=n)

  batch = _batch()
  results = {n: step(_params(), batch, n) for n in (0, 1, 2, 4, 9)}
  helpers.assert_trees_equal(results[0], results[1])  # clamped to 1
  helpers.assert_trees_equal(results[9], results[4])  # clamped to K
  assert not helpers.trees_close(results[1][1], results[2][1])
  full = fn(_params(), jnp.float32(0.0), batch, rng=jax.random.key(0))
  helpers.assert_trees_close(results[4], full, rtol=1e-5, atol=1e-6)


def test_the_loop_is_a_while_loop_with_the_traced_count():
  def primitives(**kwargs):
    jaxpr = jax.make_jaxpr(lambda p, b, n: _fn()(
        p, jnp.float32(0.0), b, rng=jax.random.key(0), **kwargs))(
            _params(), _batch(), 2)
    return {eqn.primitive.name for eqn in jaxpr.eqns}

  assert "while" in primitives(num_real_microbatches=2) - {"scan"}
  assert "scan" in primitives()


@pytest.mark.parametrize("n", [0, K + 1, -1])
def test_a_concrete_n_outside_the_range_is_named(n):
  with pytest.raises(ValueError, match=rf"num_real_microbatches={n}.*\[1"):
    _fn()(_params(), jnp.float32(0.0), _batch(), rng=jax.random.key(0),
          num_real_microbatches=n)


@pytest.mark.parametrize("n", [1.5, True, jnp.ones(2, jnp.int32)])
def test_a_non_integer_n_is_named(n):
  with pytest.raises(TypeError, match="num_real_microbatches"):
    _fn()(_params(), jnp.float32(0.0), _batch(), rng=jax.random.key(0),
          num_real_microbatches=n)


def test_a_misspelt_n_is_named_not_passed_to_the_loss():
  def loss(params, batch, **kwargs):  # would swallow the typo.
    del kwargs
    return helpers.safe_mean(helpers.linear_token_losses(params, batch), batch)

  fn = oa.value_and_grad(loss, num_microbatches=K,
                         num_tokens_fn=helpers.num_tokens)
  with pytest.raises(TypeError, match="did you mean 'num_real_microbatches'"):
    fn(_params(), _batch(), num_real_microbatch=2)


def test_a_loss_keyword_that_only_looks_like_n_is_passed_on():
  def loss(params, batch, num_real_microbatch=0.0):
    token_losses = helpers.linear_token_losses(params, batch)
    return helpers.safe_mean(token_losses, batch) + num_real_microbatch

  fn = oa.value_and_grad(loss, num_microbatches=K,
                         num_tokens_fn=helpers.num_tokens)
  value, _ = fn(_params(), _batch(), num_real_microbatch=1.0)
  plain, _ = fn(_params(), _batch())
  np.testing.assert_allclose(value, plain + 1.0, rtol=1e-5)


def test_the_planner_refuses_n_and_says_where_it_goes():
  with pytest.raises(TypeError, match=r"plan\.value_and_grad\(.*num_real"):
    oa.plan_microbatches(
        loss_fn, _params(), jnp.float32(0.0), _batch(), memory_budget=2**30,
        has_aux=True, has_state=True, num_tokens_fn=helpers.num_tokens,
        rng=jax.random.key(0), num_real_microbatches=2)


@pytest.mark.slow
def test_with_axis_name_each_device_runs_its_first_n():
  devices, n = 8, 2

  def plain_loss(params, batch):
    return helpers.safe_mean(helpers.linear_token_losses(params, batch),
                             batch)

  batch = _batch(devices * K * ROWS, seed=1)
  fn = oa.value_and_grad(plain_loss, num_microbatches=K,
                         num_tokens_fn=helpers.num_tokens, axis_name="data")
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    loss, grads = jax.jit(fn)(jax.device_put(_params(), P()),
                              jax.device_put(batch, P("data")),
                              num_real_microbatches=jnp.int32(n))
  # Device d's micro-batch i: its shard's rows [i * ROWS, (i + 1) * ROWS).
  kept = jax.tree.map(
      lambda x: x.reshape((devices, K * ROWS) + x.shape[1:])[:, :n * ROWS]
      .reshape((-1,) + x.shape[1:]), batch)
  exp_loss, exp_grads = jax.value_and_grad(plain_loss)(_params(), kept)
  helpers.assert_trees_close((loss, grads), (exp_loss, exp_grads), rtol=1e-5,
                             atol=1e-6)
