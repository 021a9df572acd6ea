"""The emitting step (emit.py): one decision, three outputs, traced once.

``tx.update`` keeps its updates in the running sum's buffer where that
buffer holds them exactly (``emit.UpdatesInSum``). What a user can see of
it: the updates handed back are the same as ever (zeros, then the inner's
update, in each parameter's dtype), and the next cycle starts from zeros.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import helpers
import optax_accum as oa


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3),
          "b": jnp.ones(3, jnp.bfloat16)}


def _grads(i):
  return {"w": jax.random.normal(jax.random.key(i), (2, 3)),
          "b": jnp.full(3, 0.25 * (i + 1), jnp.bfloat16)}


def _reference_updates(inner, grads, tokens, params):
  """The inner's update on the token-weighted mean, by hand."""
  total = sum(tokens)
  mean = jax.tree.map(
      lambda *g: sum(n * x.astype(jnp.float32) for n, x in zip(tokens, g))
      / total, *grads)
  mean = jax.tree.map(lambda m, p: m.astype(p.dtype), mean, params)
  return inner.update(mean, inner.init(params), params)[0]


@pytest.mark.parametrize("jit", [True, False])
def test_kept_updates_are_the_inner_update_and_the_state_holds_them(jit):
  inner = optax.adam(0.1)
  tx = oa.accumulate(inner, every_k=2)
  params = _params()
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(params)
  updates, state = update(_grads(0), state, params, num_tokens=3)
  assert not oa.has_updated(state)
  for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)):
    assert u.dtype == p.dtype and not jnp.any(u)
  updates, state = update(_grads(1), state, params, num_tokens=1)
  assert oa.has_updated(state)
  expected = _reference_updates(inner, [_grads(0), _grads(1)], [3, 1],
                                params)
  helpers.assert_trees_close(updates, expected, rtol=1e-5)
  assert jax.tree.map(lambda u: u.dtype, updates) == jax.tree.map(
      lambda p: p.dtype, params)
  # Kept in the sum's buffer, in its float32: exactly the updates.
  kept = oa.find_accumulate_state(state).grad_sum
  assert kept["b"].dtype == jnp.float32
  helpers.assert_trees_equal(
      jax.tree.map(lambda k, u: k.astype(u.dtype), kept, updates), updates)
  # The next cycle starts from zeros, not from them.
  _, state = update(_grads(2), state, params, num_tokens=2)
  helpers.assert_trees_close(
      oa.find_accumulate_state(state).grad_sum,
      jax.tree.map(lambda g: 2 * g.astype(jnp.float32), _grads(2)))


def test_a_sum_that_cannot_hold_the_updates_keeps_the_sum():
  """A bfloat16 sum would round float32 updates: they leave as before."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=1,
                     accumulator_dtype=jnp.bfloat16)
  params = {"w": jnp.zeros(3)}
  grads = {"w": jnp.array([1.0, 2.0, 3.0])}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params,
                                      num_tokens=1)
  helpers.assert_trees_equal(updates, {"w": -grads["w"]})
  helpers.assert_trees_equal(oa.find_accumulate_state(state).grad_sum,
                             {"w": grads["w"].astype(jnp.bfloat16)})


@pytest.mark.parametrize("jit", [True, False])
def test_apply_if_updated_reads_only_the_updates_it_was_given(jit):
  """Updates changed after tx.update (scaled, clipped, or another call's)
  are applied as given, never the kept ones."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=1, equal_weights=True)
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.array([1.0, 2.0, 3.0])}

  def step(params, state, scale):
    updates, state = tx.update(grads, state, params)
    as_given = oa.apply_if_updated(params, updates, state)
    scaled = oa.apply_if_updated(
        params, jax.tree.map(lambda u: scale * u, updates), state)
    return as_given, scaled

  step = jax.jit(step) if jit else step
  as_given, scaled = step(params, tx.init(params), 2.0)
  helpers.assert_trees_equal(as_given, {"w": 1.0 - grads["w"]})
  helpers.assert_trees_equal(scaled, {"w": 1.0 - 2.0 * grads["w"]})


def test_apply_if_updated_with_a_later_calls_state_decides_by_that_state():
  """The updates of an emitting call with the state of a later,
  non-emitting one: nothing is applied, as has_updated(state) says."""
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  params = {"w": jnp.ones(2)}

  @jax.jit
  def step(params, state):
    _, state = tx.update({"w": jnp.ones(2)}, state, params)
    updates, emitted = tx.update({"w": jnp.ones(2)}, state, params)
    applied = oa.apply_if_updated(params, updates, emitted)
    _, skipped = tx.update({"w": jnp.ones(2)}, emitted, params)
    return applied, oa.apply_if_updated(params, updates, skipped)

  applied, kept = step(params, tx.init(params))
  helpers.assert_trees_equal(applied, {"w": jnp.zeros(2)})
  helpers.assert_trees_equal(kept, params)


def test_two_micro_steps_in_one_jit_apply_each_their_own():
  """Two tx.update calls traced together: each apply_if_updated finds the
  updates of its own call (a Python loop of micro-steps in one step)."""
  inner = optax.sgd(0.5)
  tx = oa.accumulate(inner, every_k=1, equal_weights=True)
  params = {"w": jnp.ones(2)}

  @jax.jit
  def two_steps(params, state):
    for g in (1.0, 3.0):
      updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
      params = oa.apply_if_updated(params, updates, state)
    return params

  helpers.assert_trees_equal(two_steps(params, tx.init(params)),
                             {"w": jnp.full(2, 1.0 - 0.5 - 1.5)})


@pytest.mark.parametrize("call", ["update", "update_and_apply"])
def test_what_each_state_field_holds_after_an_emitting_call(call):
  """AccumulateState's docstring, field by field, after an emit: a new
  cycle's zeros, the counts advanced; grad_sum is scratch the next call
  overwrites (what it holds is not part of the contract)."""
  tx = oa.accumulate(optax.adam(0.1), every_k=2, with_stats=True)
  params = _params()
  state = tx.init(params)
  step = ((lambda g, s, n: tx.update(g, s, params, num_tokens=n, value=1.0)[1])
          if call == "update" else
          (lambda g, s, n: tx.update_and_apply(g, s, params, num_tokens=n,
                                               value=1.0)[1]))
  state = jax.jit(step)(_grads(0), state, 3.0)
  state = jax.jit(step)(_grads(1), state, 1.0)
  assert int(state.micro_step) == 0 and int(state.count) == 1
  assert bool(state.emitted) and float(state.token_count) == 0.0
  assert float(state.tokens_seen) == 4.0
  assert int(state.nonfinite_count) == 0 and int(state.skipped_count) == 0
  helpers.assert_trees_equal(state.stats_sums,
                             jax.tree.map(jnp.zeros_like, state.stats_sums))
  helpers.assert_trees_equal(state.value_sums,
                             jax.tree.map(jnp.zeros_like, state.value_sums))
  assert int(state.inner_state[0].count) == 1  # adam stepped once.
  # The next cycle starts from zeros whatever the scratch holds.
  state = jax.jit(step)(_grads(2), state, 2.0)
  helpers.assert_trees_close(
      state.grad_sum,
      jax.tree.map(lambda g: 2 * g.astype(jnp.float32), _grads(2)))
