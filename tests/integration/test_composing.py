"""The compositions of docs/composing.md, each against the same optax chain
fed the full batch: a small MLP, uneven token counts (one micro-batch
empty), several updates.

``differences()`` gives each composition's largest parameter difference
from the full batch (the table in the issue's note comes from it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

K, UPDATES, DIM = 3, 3, 4


def _data():
  micro = helpers.uneven_micro_batches(K * UPDATES, seed=3, rows=4, seq=5,
                                       dim=DIM, devices=1)
  windows = [micro[u * K:(u + 1) * K] for u in range(UPDATES)]
  return windows


def _labels(params):
  return {name: "adam" if name.startswith("w") else "sgd" for name in params}


def _is_weight(params):
  return {name: name.startswith("w") for name in params}


def _not_weight(params):
  return {name: not name.startswith("w") for name in params}


_SCHEDULE = optax.linear_schedule(0.05, 0.01, UPDATES)

# name -> (the chain fed the full batch, the accumulated transformation).
COMPOSITIONS = {
    "clip_by_global_norm inside": (
        lambda: optax.chain(optax.clip_by_global_norm(0.05),
                            optax.adamw(_SCHEDULE, weight_decay=0.1)),
        lambda inner: oa.accumulate(inner, K)),
    "masked inside": (
        lambda: optax.chain(optax.masked(optax.adam(0.05), _is_weight),
                            optax.masked(optax.sgd(0.05), _not_weight)),
        lambda inner: oa.accumulate(inner, K)),
    "multi_transform inside": (
        lambda: optax.multi_transform(
            {"adam": optax.adam(0.05), "sgd": optax.sgd(0.05)}, _labels),
        lambda inner: oa.accumulate(inner, K)),
    "inject_hyperparams (a schedule) inside": (
        lambda: optax.inject_hyperparams(optax.adamw)(
            learning_rate=_SCHEDULE, weight_decay=0.1),
        lambda inner: oa.accumulate(inner, K)),
    "reduce_on_plateau inside, value=": (
        lambda: optax.chain(
            optax.adam(0.05),
            optax.contrib.reduce_on_plateau(factor=0.5, patience=1,
                                            accumulation_size=1)),
        lambda inner: oa.accumulate(inner, K)),
    "schedule_free inside": (
        lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2),
        lambda inner: oa.accumulate(inner, K)),
    "apply_if_finite inside": (
        lambda: optax.apply_if_finite(optax.adam(0.05), 3),
        lambda inner: oa.accumulate(inner, K)),
    "skip_nonfinite (no NaN here)": (
        lambda: optax.adam(0.05),
        lambda inner: oa.accumulate(inner, K, skip_nonfinite=True)),
}

# Placements that are not the full batch's: the negative controls.
NOT_EXACT = {
    "clip_by_global_norm outside (clips each micro-batch)": (
        lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5)),
        lambda inner: optax.chain(optax.clip_by_global_norm(0.05),
                                  oa.accumulate(optax.sgd(0.5), K))),
}


def _full_batch_run(make_full, windows, params):
  tx = make_full()
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(helpers.mlp_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params, value=loss)
    return optax.apply_updates(params, updates), state

  for window in windows:
    batch = jax.tree.map(lambda *x: jnp.concatenate(x), *window)
    params, state = step(params, state, batch)
  return params


def _accumulated_run(make_full, wrap, windows, params):
  tx = wrap(make_full())
  state = tx.init(params)

  @jax.jit
  def micro_step(params, state, mb):
    loss, grads = jax.value_and_grad(helpers.mlp_mean_loss)(params, mb)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(mb), value=loss)
    return optax.apply_updates(params, updates), state

  for window in windows:
    for mb in window:
      params, state = micro_step(params, state, mb)
  return params


def _difference(make_full, wrap):
  windows = _data()
  params = helpers.mlp_params(DIM, 8, seed=0)
  full = _full_batch_run(make_full, windows, params)
  acc = _accumulated_run(make_full, wrap, windows, params)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(full), jax.tree.leaves(params)))
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(full), jax.tree.leaves(acc)))
  return diff, moved


def differences() -> dict[str, tuple[float, float]]:
  """Each composition's (largest difference from the full batch, largest
  move of a parameter), for the record."""
  return {name: _difference(*pair)
          for name, pair in {**COMPOSITIONS, **NOT_EXACT}.items()}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
@pytest.mark.slow
def test_matches_the_full_batch(name):
  diff, moved = _difference(*COMPOSITIONS[name])
  assert moved > 1e-2, (name, moved)  # the run did something.
  assert diff < 2e-6, (name, diff)


@pytest.mark.parametrize("name", sorted(NOT_EXACT))
@pytest.mark.slow
def test_placements_the_page_warns_of_differ(name):
  diff, _ = _difference(*NOT_EXACT[name])
  assert diff > 1e-3, (name, diff)


@pytest.mark.slow
def test_one_call_value_for_reduce_on_plateau():
  # The one-call recipe: the loss value_and_grad returns is the full
  # batch's, exactly what the plateau logic needs.
  windows = _data()
  params = helpers.mlp_params(DIM, 8, seed=0)
  make = COMPOSITIONS["reduce_on_plateau inside, value="][0]
  tx = make()
  state = tx.init(params)
  grad_fn = jax.jit(oa.value_and_grad(
      helpers.mlp_mean_loss, num_microbatches=K,
      num_tokens_fn=helpers.num_tokens))
  for window in windows:
    batch = jax.tree.map(lambda *x: jnp.concatenate(x), *window)
    loss, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params, value=loss)
    params = optax.apply_updates(params, updates)
  full = _full_batch_run(make, windows, helpers.mlp_params(DIM, 8, seed=0))
  helpers.assert_trees_close(params, full, rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_multi_transform_outside_with_every_group_accumulated():
  windows = _data()
  params = helpers.mlp_params(DIM, 8, seed=0)
  make = lambda: optax.multi_transform(
      {"adam": optax.adam(0.05), "sgd": optax.sgd(0.05)}, _labels)
  outside = optax.multi_transform(
      {"adam": oa.accumulate(optax.adam(0.05), K),
       "sgd": oa.accumulate(optax.sgd(0.05), K)}, _labels)
  acc = _accumulated_run(lambda: outside, lambda tx: tx, windows, params)
  full = _full_batch_run(make, windows, params)
  helpers.assert_trees_close(acc, full, rtol=1e-5, atol=2e-6)


if __name__ == "__main__":
  for key, (d, m) in differences().items():
    print(f"{key:55s} {d:.2e} (parameters moved up to {m:.2e})")
  np.set_printoptions(precision=3)
