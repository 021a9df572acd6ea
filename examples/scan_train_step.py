"""The shortest complete train step: oa.value_and_grad + any optax optimizer.

One jitted call per batch; inside, a ``lax.scan`` runs the micro-batches one at
a time (so only one micro-batch's activations are alive) and returns the exact
gradient of the whole batch's per-token mean loss. Copy ``train_step``.

The batch is a masked linear regression whose padding rows (mask 0) crowd into
the first micro-batches, so the micro-batches hold very different numbers of
real rows; ``num_tokens_fn`` weighs each by its count. The script checks the
micro-batched loss and gradient against ``jax.value_and_grad`` of the whole
batch, then fits the regression (300 steps of AdamW) and prints both.

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


def loss_fn(params, batch):  # mean squared error over the unmasked rows
  err = batch["mask"] * (batch["x"] @ params["w"] + params["b"] - batch["y"])
  return (err**2).sum() / jnp.maximum(batch["mask"].sum(), 1.0)


optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
grad_fn = oa.value_and_grad(loss_fn, num_microbatches=4,
                            num_tokens_fn=lambda mb: mb["mask"].sum())


@jax.jit
def train_step(params, opt_state, batch):
  loss, grads = grad_fn(params, batch)  # == jax.value_and_grad(loss_fn)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def example_batch() -> dict[str, jax.Array]:
  """64 rows of y = x @ w + 0.5; padding rows (mask 0) crowd in at the start."""
  x = jax.random.normal(jax.random.key(0), (64, 8))
  true_w = jnp.arange(8.0)[:, None] / 8
  keep = jax.random.uniform(jax.random.key(1), (64,)) < jnp.linspace(0.1, 1, 64)
  mask = keep.astype(jnp.float32)
  return {"x": x, "y": x @ true_w + 0.5, "mask": mask[:, None]}


def initial_params() -> dict[str, jax.Array]:
  return {"w": jnp.zeros((8, 1)), "b": jnp.zeros(1)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Checks the micro-batched gradient, then fits; returns losses and errors."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300, help="train steps")
  args = parser.parse_args(argv)
  batch = example_batch()
  params = initial_params()
  # The micro-batched loss and gradient are those of the whole batch:
  full_loss, full_grads = jax.value_and_grad(loss_fn)(params, batch)
  loss, grads = grad_fn(params, batch)
  opt_state = optimizer.init(params)
  losses = []
  for _ in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state, batch)
    losses.append(float(loss))
  results = {
      "losses": losses,
      "loss_error": float(jnp.abs(losses[0] - full_loss)),
      "grad_error": max(float(jnp.abs(g - f).max()) for g, f in zip(
          jax.tree.leaves(grads), jax.tree.leaves(full_grads))),
  }
  print(f"loss {losses[0]:.4f} -> {losses[-1]:.2e}; vs the full batch's"
        f" jax.value_and_grad: |loss diff| {results['loss_error']:.1e},"
        f" max |grad diff| {results['grad_error']:.1e}")
  return results


if __name__ == "__main__":
  main()
