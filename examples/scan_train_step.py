"""The shortest complete train step: oa.value_and_grad + any optax optimizer.

One jitted call per batch; inside, a ``lax.scan`` runs the micro-batches one at
a time (so only one micro-batch's activations are alive) and returns the exact
gradient of the whole batch's per-token mean loss. Copy ``train_step``.

The batch is a masked linear regression whose padding rows (mask 0) crowd into
the first micro-batches, so the micro-batches hold very different numbers of
real rows; ``num_tokens_fn`` weighs each by its count. The model applies
dropout to its inputs while training: ``rng=`` hands every micro-batch its own
key (one key for all would repeat one mask). The metric, the fraction of real
rows predicted within 0.25, comes back with ``aux_reduction="mean"``: weighted
by the micro-batches' row counts, it is the whole batch's, where the plain
mean of per-micro-batch fractions is not. The script checks the micro-batched
loss, gradient and metric against the whole batch (without dropout), then fits
the regression (300 steps of AdamW) and prints both.

Run it (a few seconds)::

  python examples/scan_train_step.py
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optax_accum as oa

DROPOUT = 0.05


def loss_fn(params, batch, *, rng=None):  # MSE over the unmasked rows
  x = batch["x"]
  if rng is not None:  # training: inverted dropout on the inputs.
    keep = jax.random.bernoulli(rng, 1.0 - DROPOUT, x.shape)
    x = jnp.where(keep, x / (1.0 - DROPOUT), 0.0)
  err = batch["mask"] * (x @ params["w"] + params["b"] - batch["y"])
  return (err**2).sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def accuracy(params, batch):  # fraction of real rows predicted within 0.25
  err = jnp.abs(batch["x"] @ params["w"] + params["b"] - batch["y"])
  hits = (batch["mask"] * (err < 0.25)).sum()
  return hits / jnp.maximum(batch["mask"].sum(), 1.0)


def loss_and_metrics(params, batch, *, rng=None):
  return loss_fn(params, batch, rng=rng), {"accuracy": accuracy(params, batch)}


optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
grad_fn = oa.value_and_grad(loss_and_metrics, num_microbatches=4,
                            has_aux=True, aux_reduction="mean",
                            num_tokens_fn=lambda mb: mb["mask"].sum())


@jax.jit
def train_step(params, opt_state, batch, rng):
  (loss, metrics), grads = grad_fn(params, batch, rng=rng)  # one key each
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss, metrics


def example_batch() -> dict[str, jax.Array]:
  """64 rows of y = x @ w + 0.5; padding rows (mask 0) crowd in at the start."""
  x = jax.random.normal(jax.random.key(0), (64, 8))
  true_w = jnp.arange(8.0)[:, None] / 8
  keep = jax.random.uniform(jax.random.key(1), (64,)) < jnp.linspace(0.1, 1, 64)
  mask = keep.astype(jnp.float32)
  return {"x": x, "y": x @ true_w + 0.5, "mask": mask[:, None]}


def initial_params() -> dict[str, jax.Array]:
  return {"w": jnp.zeros((8, 1)), "b": jnp.zeros(1)}


def _max_diff(tree, other) -> float:
  return max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(tree), jax.tree.leaves(other)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Checks the micro-batched values, then fits; returns losses and errors."""
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="train steps")
  parser.add_argument("--seed", type=int, default=0, help="dropout seed")
  args = parser.parse_args(argv)
  batch = example_batch()
  params = initial_params()
  # Without rng (no dropout) the micro-batched loss, gradient and metric are
  # those of the whole batch:
  full_loss, full_grads = jax.value_and_grad(loss_fn)(params, batch)
  (loss, metrics), grads = grad_fn(params, batch)
  accuracy_error = abs(float(metrics["accuracy"] - accuracy(params, batch)))
  opt_state = optimizer.init(params)
  key = jax.random.key(args.seed)
  losses = []
  for step in range(args.steps):
    params, opt_state, loss_value, _ = train_step(
        params, opt_state, batch, jax.random.fold_in(key, step))
    losses.append(float(loss_value))
  (eval_loss, eval_metrics), _ = grad_fn(params, batch)  # no dropout
  results = {
      "losses": losses,
      "eval_loss": float(eval_loss),
      "accuracy": float(eval_metrics["accuracy"]),
      "loss_error": float(jnp.abs(loss - full_loss)),
      "grad_error": _max_diff(grads, full_grads),
      "initial_accuracy": float(metrics["accuracy"]),
      "accuracy_error": accuracy_error,
  }
  print(f"loss {losses[0]:.4f} -> {results['eval_loss']:.2e} (no dropout),"
        f" accuracy {results['initial_accuracy']:.2f} ->"
        f" {results['accuracy']:.2f}; vs the whole batch: |loss"
        f" diff| {results['loss_error']:.1e}, max |grad diff|"
        f" {results['grad_error']:.1e}, |accuracy diff|"
        f" {results['accuracy_error']:.1e}")
  return results


if __name__ == "__main__":
  main()
