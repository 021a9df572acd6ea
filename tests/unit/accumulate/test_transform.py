"""Unit tests of oa.accumulate: emission, normalisation, dtypes, NaN, counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa


def _grads(seed, params=None, dtype=jnp.float32):
  params = helpers.layer_params() if params is None else params
  keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
  leaves = [
      jax.random.normal(k, jnp.shape(p)).astype(dtype)
      for k, p in zip(keys, jax.tree.leaves(params))
  ]
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _run(tx, grads_and_tokens, params=None, jit=True):
  params = helpers.layer_params() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  outs = []
  for grads, tokens in grads_and_tokens:
    updates, state = update(grads, state, params, num_tokens=tokens)
    outs.append((updates, state))
  return outs


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_emits_exact_token_weighted_mean(jit, loss_reduction):
  tokens = [3.0, 1.0, 7.0]
  grads = [_grads(i) for i in range(3)]
  tx = oa.accumulate(optax.sgd(1.0), 3, loss_reduction=loss_reduction)
  outs = _run(tx, zip(grads, tokens), jit=jit)
  weights = tokens if loss_reduction == "mean" else [1.0, 1.0, 1.0]
  expected = jax.tree.map(
      lambda *gs: -sum(w * g for w, g in zip(weights, gs)) / sum(tokens),
      *grads,
  )
  helpers.assert_trees_close(outs[-1][0], expected, rtol=1e-5, atol=1e-6)
  mean_of_means = jax.tree.map(lambda *gs: -sum(gs) / 3, *grads)
  assert not helpers.trees_close(outs[-1][0], mean_of_means, rtol=1e-3)


def test_non_emitting_updates_are_exactly_zero_and_has_updated():
  tx = oa.accumulate(optax.adam(0.1), 4)
  outs = _run(tx, [(_grads(i), i + 1) for i in range(12)])
  for i, (updates, state) in enumerate(outs):
    emitting = (i + 1) % 4 == 0
    assert bool(oa.has_updated(state)) == emitting
    assert int(state.count) == (i + 1) // 4
    assert int(state.micro_step) == (i + 1) % 4
    leaves = jax.tree.leaves(updates)
    if emitting:
      assert all(np.any(np.asarray(u) != 0) for u in leaves)
    else:
      assert all(np.all(np.asarray(u) == 0) for u in leaves)


def test_initial_state():
  state = oa.accumulate(optax.sgd(1.0), 2).init(helpers.layer_params())
  assert not bool(oa.has_updated(state))
  assert state.micro_step.dtype == jnp.int32 and state.count.dtype == jnp.int32
  assert state.token_count.dtype == jnp.float32
  assert state.token_count.shape == ()
  helpers.assert_trees_equal(state.grad_sum, helpers.layer_params())


def _counting(inner, calls):
  """Wraps ``inner`` so that every executed ``update`` appends to ``calls``."""

  def update_fn(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update_fn)


def test_inner_runs_only_on_emitting_micro_steps():
  calls = []
  tx = oa.accumulate(_counting(optax.adam(0.1), calls), 4)
  outs = _run(tx, [(_grads(i), 1) for i in range(10)], jit=True)
  jax.effects_barrier()
  assert len(calls) == 2 == int(outs[-1][1].count)


def test_inner_step_count_equals_updates():
  tx = oa.accumulate(optax.adam(0.1), 3)
  outs = _run(tx, [(_grads(i), 1) for i in range(9)])
  state = outs[-1][1]
  inner_count = optax.tree.get(state.inner_state, "count")
  assert int(inner_count) == int(state.count) == 3


def test_no_retracing_across_micro_steps():
  traces = []
  tx = oa.accumulate(optax.adamw(0.1), 3)

  @jax.jit
  def step(params, state, grads, tokens):
    traces.append(1)
    updates, state = tx.update(grads, state, params, num_tokens=tokens)
    return optax.apply_updates(params, updates), state

  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  for i in range(7):
    params, state = step(params, state, _grads(i), jnp.float32(i + 1))
  assert len(traces) == 1


def test_bf16_gradients_accumulate_in_float32():
  params = {"w": jnp.zeros(4, jnp.bfloat16)}
  # 1 + 255 * 2**-9 is exact in float32; bf16 (8 bits of mantissa) rounds every
  # small addition away once the sum reaches 1.
  grads = [{"w": jnp.ones(4, jnp.bfloat16)}] + [
      {"w": jnp.full(4, 2.0**-9, jnp.bfloat16)}
  ] * 255
  tx = oa.accumulate(optax.identity(), 256, loss_reduction="sum",
                     equal_weights=True)
  state = tx.init(params)
  assert state.grad_sum["w"].dtype == jnp.float32
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(g, state, params)
  assert updates["w"].dtype == jnp.bfloat16
  expected = (1 + 255 * 2.0**-9) / 256
  np.testing.assert_allclose(
      np.asarray(updates["w"], np.float32), expected, rtol=2**-8
  )
  bf16_sum = jnp.bfloat16(0)
  for g in grads:
    bf16_sum = bf16_sum + g["w"][0]
  assert abs(float(bf16_sum) / 256 - expected) > expected * 2**-8


def test_skip_nonfinite_drops_micro_step_without_poisoning():
  nan_grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(1))
  feed = [(_grads(0), 2.0), (nan_grads, 5.0), (_grads(2), 3.0),
          (_grads(3), 1.0), (_grads(4), 1.0), (_grads(5), 1.0)]
  tx = oa.accumulate(optax.sgd(1.0), 3, skip_nonfinite=True)
  outs = _run(tx, feed)
  first = jax.tree.map(
      lambda a, b: -(2 * a + 3 * b) / 5, _grads(0), _grads(2)
  )
  helpers.assert_trees_close(outs[2][0], first, rtol=1e-5, atol=1e-6)
  second = jax.tree.map(
      lambda *gs: -sum(gs) / 3, *[_grads(i) for i in (3, 4, 5)]
  )
  helpers.assert_trees_close(outs[5][0], second, rtol=1e-5, atol=1e-6)
  assert int(outs[-1][1].nonfinite_count) == 1
  assert int(outs[-1][1].count) == 2


def test_nan_without_skip_poisons_only_its_own_cycle():
  nan_grads = jax.tree.map(lambda g: g.at[0].set(jnp.inf), _grads(1))
  feed = [(_grads(0), 1.0), (nan_grads, 1.0),
          (_grads(3), 1.0), (_grads(4), 1.0)]
  outs = _run(oa.accumulate(optax.sgd(1.0), 2), feed)
  assert not np.all(np.isfinite(np.asarray(outs[1][0]["w"])))
  second = jax.tree.map(lambda a, b: -(a + b) / 2, _grads(3), _grads(4))
  helpers.assert_trees_close(outs[3][0], second, rtol=1e-6)


def test_zero_token_cycle_emits_zeros_and_keeps_inner_state():
  tx = oa.accumulate(optax.adam(0.1), 2)
  outs = _run(tx, [(_grads(0), 1.0), (_grads(1), 1.0),
                   (_grads(2), 0.0), (_grads(3), 0.0)])
  updates, state = outs[3]
  helpers.assert_trees_equal(
      updates, jax.tree.map(jnp.zeros_like, helpers.layer_params()))
  helpers.assert_trees_equal(state.inner_state, outs[1][1].inner_state)
  assert not bool(oa.has_updated(state))
  assert int(state.count) == 1 and int(state.micro_step) == 0
  assert float(state.token_count) == 0.0


def test_zero_token_micro_batch_with_nan_mean_contributes_nothing():
  # A loss averaged over zero tokens is 0/0; its weight is zero, and it must not
  # turn the cycle's sum into NaN.
  nan_grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), _grads(0))
  outs = _run(oa.accumulate(optax.sgd(1.0), 2),
              [(nan_grads, 0.0), (_grads(1), 4.0)])
  helpers.assert_trees_close(
      outs[1][0], jax.tree.map(jnp.negative, _grads(1)), rtol=1e-6
  )


def test_all_micro_steps_nonfinite_is_a_zero_token_cycle():
  nan_grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), _grads(0))
  tx = oa.accumulate(optax.adam(0.1), 2, skip_nonfinite=True)
  outs = _run(tx, [(nan_grads, 1.0), (nan_grads, 1.0)])
  updates, state = outs[-1]
  helpers.assert_trees_equal(
      updates, jax.tree.map(jnp.zeros_like, helpers.layer_params()))
  helpers.assert_trees_equal(
      state.inner_state, tx.init(helpers.layer_params()).inner_state)
  assert int(state.nonfinite_count) == 2


def test_callable_every_k_follows_the_update_count():
  tx = oa.accumulate(optax.sgd(1.0), lambda count: jnp.where(count < 2, 2, 3))
  outs = _run(tx, [(_grads(i), 1.0) for i in range(10)])
  emitted = [i for i, (_, s) in enumerate(outs) if oa.has_updated(s)]
  assert emitted == [1, 3, 6, 9]


def test_extra_args_reach_the_inner_optimizer():
  inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau())
  tx = oa.accumulate(inner, 2, equal_weights=True)
  params = helpers.layer_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  best = []
  for value in (5.0, 4.0, 3.0, 2.0):
    _, state = update(_grads(0), state, params, value=jnp.float32(value))
    best.append(float(optax.tree.get(state.inner_state, "best_value")))
  # The inner optimizer runs on the emitting calls only, and gets the
  # window's mean value (equal weights here), not the emitting call's.
  assert best[0] == float("inf") and best[1] == 4.5 and best[3] == 2.5


def test_works_inside_chain_and_with_inject_hyperparams():
  inner = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)
  tx = optax.chain(optax.clip(10.0), oa.accumulate(inner, 2))
  outs = _run(tx, [(_grads(i), 1.0) for i in range(4)])
  state = oa.find_accumulate_state(outs[-1][1])
  assert int(state.count) == 2
  assert bool(oa.has_updated(outs[-1][1]))


def test_find_accumulate_state_rejects_trees_without_one():
  with pytest.raises(ValueError, match="AccumulateState"):
    oa.find_accumulate_state(optax.adam(0.1).init(helpers.layer_params()))


def test_state_is_a_pytree_of_arrays():
  state = oa.accumulate(optax.adamw(0.1), 2).init(helpers.layer_params())
  assert isinstance(state, oa.AccumulateState)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))


def test_strict_dtype_promotion_in_our_code():
  params = {"w": jnp.zeros(3, jnp.bfloat16), "b": jnp.zeros(2)}
  tx = oa.accumulate(optax.sgd(0.5), 2, skip_nonfinite=True)
  state = tx.init(params)
  grads = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
  with jax.numpy_dtype_promotion("strict"):
    for tokens in (jnp.int32(3), 2.0):
      updates, state = jax.jit(tx.update)(grads, state, params,
                                          num_tokens=tokens)
  assert updates["w"].dtype == jnp.bfloat16
  assert updates["b"].dtype == jnp.float32
