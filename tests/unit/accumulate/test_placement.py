"""``accumulate`` in optax's wrappers: ``apply_if_finite`` outside is
refused, inside or ``skip_nonfinite`` keep every update boundary; the state
read and written through by the documented ways; swapped arguments named."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K, UPDATES = 4, 6


def _micro_batches(nan_at=5):
  """(grads, num_tokens) of 24 micro-batches; one has a NaN gradient."""
  rng = np.random.default_rng(0)
  out = []
  for i in range(K * UPDATES):
    g = {"w": jnp.asarray(rng.normal(size=3), jnp.float32)}
    if i == nan_at:
      g = {"w": jnp.full(3, jnp.nan)}
    out.append((g, float(rng.integers(1, 5))))
  return out


def _run(tx, micro_batches):
  params = helpers.vector_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  emitted = []
  for i, (g, n) in enumerate(micro_batches):
    updates, state = update(g, state, params, num_tokens=n)
    params = optax.apply_updates(params, updates)
    if oa.has_updated(state):
      emitted.append(i)
  return params, state, emitted


def _window_means(micro_batches, drop):
  """The exact window means, micro-batches in ``drop`` left out."""
  means = []
  for u in range(UPDATES):
    window = [(g, n) for i, (g, n) in enumerate(micro_batches)
              if u * K <= i < (u + 1) * K and i not in drop]
    weights = [n / sum(n for _, n in window) for _, n in window]
    means.append(jax.tree.map(
        lambda *g, w=weights: sum(wi * x for wi, x in zip(w, g)),
        *[g for g, _ in window]))
  return means


def test_apply_if_finite_outside_accumulate_is_refused():
  tx = optax.apply_if_finite(oa.accumulate(optax.sgd(0.1), K), 3)
  with pytest.raises(ValueError, match="skip_nonfinite=True") as e:
    tx.init(helpers.vector_params())
  assert "optax.apply_if_finite" in str(e.value)
  # Also where the wrapper holds a chain that holds us, and under jit.
  tx = optax.apply_if_finite(
      optax.chain(optax.clip(1.0), oa.accumulate(optax.sgd(0.1), K)), 3)
  with pytest.raises(ValueError, match="boundary shifts"):
    jax.jit(tx.init)(helpers.vector_params())


@pytest.mark.slow
def test_what_apply_if_finite_outside_would_do():
  # The refused placement's silent failure, with the inner wrapped by hand
  # as the wrapper does: the NaN micro-batch never reaches accumulate.
  tx = oa.accumulate(optax.sgd(0.1), K)
  params, state = helpers.vector_params(), tx.init(helpers.vector_params())
  emitted = 0
  for g, n in _micro_batches():
    if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g)):
      continue  # rejected: state kept.
    _, state = tx.update(g, state, params, num_tokens=n)
    emitted += bool(oa.has_updated(state))
  assert (emitted, int(state.micro_step)) == (5, 3)


def test_skip_nonfinite_drops_the_micro_batch_not_the_boundary():
  micro_batches = _micro_batches()
  tx = oa.accumulate(optax.sgd(1.0), K, skip_nonfinite=True)
  params, state, emitted = _run(tx, micro_batches)
  assert emitted == [K * (u + 1) - 1 for u in range(UPDATES)]
  assert int(state.nonfinite_count) == 1
  expected = jax.tree.map(lambda *m: -sum(m),
                          *_window_means(micro_batches, drop={5}))
  helpers.assert_trees_close(params, expected, rtol=1e-5)


def test_apply_if_finite_inside_drops_the_windows_update():
  micro_batches = _micro_batches()
  tx = oa.accumulate(optax.apply_if_finite(optax.sgd(1.0), 3), K)
  params, state, emitted = _run(tx, micro_batches)
  assert emitted == [K * (u + 1) - 1 for u in range(UPDATES)]
  assert int(state.micro_step) == 0
  means = _window_means(micro_batches, drop=set())
  expected = jax.tree.map(
      lambda *m: -sum(x for u, x in enumerate(m) if u != 1), *means)
  helpers.assert_trees_close(params, expected, rtol=1e-5)
  assert int(optax.tree.get(state, "total_notfinite")) == 1


def test_hyperparams_read_and_set_through_our_state():
  tx = oa.accumulate(optax.inject_hyperparams(optax.adamw)(learning_rate=0.1),
                     every_k=2)
  state = tx.init(helpers.vector_params())
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.1)
  state.hyperparams["learning_rate"] = jnp.float32(0.5)
  assert float(state.inner_state.hyperparams["learning_rate"]) == 0.5
  assert float(optax.tree.get(state, "learning_rate")) == 0.5
  state = optax.tree.set(state, learning_rate=jnp.float32(0.25))
  assert float(state.hyperparams["learning_rate"]) == 0.25
  # Inside a chain too, where one state has the field.
  tx = oa.accumulate(optax.chain(
      optax.clip(1.0),
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.3)), 2)
  state = tx.init(helpers.vector_params())
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.3)


def test_hyperparams_set_through_our_state_reach_the_update():
  tx = oa.accumulate(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0),
                     every_k=1)
  params = helpers.vector_params()
  state = tx.init(params)
  state.hyperparams["learning_rate"] = jnp.float32(0.5)
  updates, _ = tx.update({"w": jnp.ones(3)}, state, params, num_tokens=1)
  helpers.assert_trees_close(updates, {"w": jnp.full(3, -0.5)})


@pytest.mark.slow
def test_schedule_free_eval_params_through_our_state():
  params = {"w": jnp.ones(3)}
  inner = optax.contrib.schedule_free_adamw(0.1)
  tx = oa.accumulate(inner, every_k=2)
  state, inner_state = tx.init(params), inner.init(params)
  grads = {"w": jnp.full(3, 0.5)}
  for _ in range(2):
    _, state = tx.update(grads, state, params, num_tokens=1)
  _, inner_state = inner.update(grads, inner_state, params)
  helpers.assert_trees_close(
      optax.contrib.schedule_free_eval_params(state, params),
      optax.contrib.schedule_free_eval_params(inner_state, params))


def test_a_missing_attribute_says_where_the_inner_state_is():
  state = oa.accumulate(optax.adam(0.1), 2).init(helpers.vector_params())
  with pytest.raises(AttributeError, match=r"state\.inner_state"):
    _ = state.hyperparams
  two = oa.accumulate(optax.chain(
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.3),
      optax.inject_hyperparams(optax.sgd)(learning_rate=0.2)), 2)
  with pytest.raises(AttributeError, match="2 fields of that name"):
    _ = two.init(helpers.vector_params()).hyperparams


@pytest.mark.parametrize("order", ["grads-params-state", "state-grads-params"])
def test_swapped_update_arguments_are_named(order):
  tx = oa.accumulate(optax.sgd(0.1), 2)
  params, grads = helpers.vector_params(), {"w": jnp.ones(3)}
  state = tx.init(params)
  args = ((grads, params, state) if order == "grads-params-state"
          else (state, grads, params))
  with pytest.raises(TypeError, match="arguments are swapped"):
    tx.update(*args)
  with pytest.raises(TypeError, match="must be an AccumulateState, got dict"):
    tx.update(grads, {"w": jnp.ones(3)}, params)
