"""accumulator_dtype per leaf (a pytree prefix of dtypes), both entry points.

A run with a tree of dtypes must give, leaf by leaf, what the run with that
leaf's dtype for every leaf gives: the dtypes do not mix.
"""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

PER_LEAF = {"w1": jnp.bfloat16, "b1": jnp.float32, "w2": "float32"}
K = 4


def _params():
  return helpers.mlp_params(8, 16, seed=1)


def _batch(rows=16):
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 5, size=rows)
  return jax.tree.map(jnp.asarray, helpers.padded_batch(rng, lengths, 4, 8))


def _loss(params, batch):
  return helpers.safe_mean(helpers.mlp_token_losses(params, batch), batch)


def _leaf(tree, name):
  return {name: tree[name]}


@pytest.mark.slow
def test_accumulate_keeps_each_leaf_in_its_dtype():
  params = _params()
  microbatches = helpers.split(_batch(), K)

  def run(accumulator_dtype):
    tx = oa.accumulate(optax.sgd(1.0), K, accumulator_dtype=accumulator_dtype)
    state = tx.init(params)
    for mb in microbatches:
      updates, state = jax.jit(tx.update)(
          jax.grad(_loss)(params, mb), state, params,
          num_tokens=helpers.num_tokens(mb))
    return updates, state

  updates, state = run(PER_LEAF)
  assert {k: v.dtype for k, v in state.grad_sum.items()} == {
      "w1": jnp.bfloat16, "b1": jnp.float32, "w2": jnp.float32}
  bf16_updates, _ = run(jnp.bfloat16)
  f32_updates, _ = run(jnp.float32)
  helpers.assert_trees_equal(_leaf(updates, "w1"), _leaf(bf16_updates, "w1"))
  for name in ("b1", "w2"):
    helpers.assert_trees_equal(_leaf(updates, name), _leaf(f32_updates, name))
  # The negative control: bfloat16 sums are not the float32 ones.
  assert not helpers.trees_close(_leaf(bf16_updates, "w1"),
                                 _leaf(f32_updates, "w1"), rtol=1e-6)


@pytest.mark.slow
def test_value_and_grad_keeps_each_leaf_in_its_dtype_and_the_loss_float32():
  params, batch = _params(), _batch()

  def run(accumulator_dtype):
    return jax.jit(oa.value_and_grad(
        _loss, num_microbatches=K, num_tokens_fn=helpers.num_tokens,
        accumulator_dtype=accumulator_dtype))(params, batch)

  loss, grads = run(PER_LEAF)
  bf16_loss, bf16_grads = run(jnp.bfloat16)
  f32_loss, f32_grads = run(jnp.float32)
  helpers.assert_trees_equal(_leaf(grads, "w1"), _leaf(bf16_grads, "w1"))
  for name in ("b1", "w2"):
    helpers.assert_trees_equal(_leaf(grads, name), _leaf(f32_grads, name))
  helpers.assert_trees_equal(loss, f32_loss)
  assert not helpers.trees_close(_leaf(bf16_grads, "w1"),
                                 _leaf(f32_grads, "w1"), rtol=1e-6)
  assert bf16_loss != f32_loss  # a single dtype is the loss's sum's too.


def test_a_prefix_covers_a_subtree():
  params = {"embed": jnp.ones((4, 2)), "layers": [jnp.ones(2), jnp.ones(3)]}
  tx = oa.accumulate(optax.sgd(1.0), 2,
                     accumulator_dtype={"embed": jnp.bfloat16,
                                        "layers": jnp.float32})
  dtypes = jax.tree.map(lambda s: s.dtype, tx.init(params).grad_sum)
  assert dtypes == {"embed": jnp.bfloat16,
                    "layers": [jnp.float32, jnp.float32]}


def test_fsdp_zero_sums_take_the_per_leaf_dtypes():
  specs = {"w1": P("data"), "b1": P("data"), "w2": P()}
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), specs)
    batch = jax.device_put(_batch(32), P("data"))
    _, grads = jax.jit(oa.value_and_grad(
        _loss, num_microbatches=2, num_tokens_fn=helpers.num_tokens,
        axis_name="data", gradient_sync="every_microbatch",
        accumulator_dtype=PER_LEAF))(params, batch)
  _, expected = jax.value_and_grad(_loss)(_params(), _batch(32))
  for name in ("b1", "w2"):
    helpers.assert_trees_close(grads[name], expected[name], rtol=1e-5,
                               atol=1e-6)
  helpers.assert_trees_close(grads["w1"], expected["w1"], rtol=3e-2,
                             atol=1e-2)
  assert not helpers.trees_close(grads["w1"], expected["w1"], rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda d: oa.accumulate(optax.sgd(1.0), 2, accumulator_dtype=d),
    lambda d: oa.value_and_grad(_loss, num_microbatches=2,
                                accumulator_dtype=d),
])
def test_a_bad_leaf_is_named_at_construction(make):
  # A None leaf is not bad: it keeps the default (the wider of float32 and
  # the parameter's dtype), as test_window_args checks.
  with pytest.raises(ValueError, match=r"accumulator_dtype\['b1'\].*int32"):
    make({"w1": jnp.float32, "b1": jnp.int32, "w2": jnp.float32})
  with pytest.raises(TypeError, match=r"accumulator_dtype\['w2'\]"):
    make({"w1": jnp.float32, "b1": jnp.float32, "w2": "not-a-dtype"})
  with pytest.raises(ValueError, match="accumulator_dtype"):
    make({})


def test_a_prefix_that_does_not_fit_the_params_is_named():
  bad = {"w1": jnp.float32, "b1": jnp.float32, "w3": jnp.float32}
  tx = oa.accumulate(optax.sgd(1.0), 2, accumulator_dtype=bad)
  with pytest.raises(ValueError, match=r"accumulator_dtype.*\['w3'\]"):
    tx.init(_params())
  fn = oa.value_and_grad(_loss, num_microbatches=2, accumulator_dtype=bad)
  with pytest.raises(ValueError, match=r"accumulator_dtype.*\['w3'\]"):
    fn(_params(), _batch())


@pytest.mark.parametrize("entry", ["accumulate", "value_and_grad"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16,
                                   {"embed": jnp.bfloat16, "w": None}])
def test_an_explicit_accumulator_narrower_than_float32_warns(entry, dtype):
  """Issue 50 item 3: the README's classic mistake, asked for by name: a
  warning at construction naming accumulator_dtype (and the leaf)."""
  with pytest.warns(UserWarning, match=r"accumulator_dtype.*narrower than"
                    r" float32") as caught:
    if entry == "accumulate":
      oa.accumulate(optax.sgd(1.0), 2, accumulator_dtype=dtype)
    else:
      oa.value_and_grad(_loss, num_microbatches=2, accumulator_dtype=dtype)
  assert caught[0].filename == __file__  # the caller's line.
  if isinstance(dtype, dict):
    assert "accumulator_dtype['embed']=bfloat16" in str(caught[0].message)


def test_float32_and_wider_accumulators_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    oa.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.float32)
    oa.accumulate(optax.sgd(1.0), 2)
