"""Three trainings from the same start, on the same batches.

(a) ``full_batch``: ``jax.value_and_grad`` of InfoNCE on the whole batch.
(b) ``coupled``: ``oa.coupled_value_and_grad`` over ``k`` micro-batches: the
    same gradient, holding one micro-batch's activations at a time.
(c) ``naive``: ``oa.value_and_grad`` over the same micro-batches, i.e. the
    mean of the micro-batches' InfoNCE losses, each with only its own
    ``batch_size / k - 1`` negatives: what gradient accumulation does to a
    contrastive loss when nothing is done about it.
"""

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import optax_accum as oa

import data
import model

RUNS = ("full_batch", "coupled", "naive")
LABELS = {
    "full_batch": "(a) full batch",
    "coupled": "(b) oa.coupled_value_and_grad",
    "naive": "(c) naive: per-micro-batch negatives",
}


def make_step(value_and_grad, optimizer, *, naive: bool):
  """A jitted train step; it also returns the whole batch's InfoNCE."""

  def step(params, opt_state, batch):
    loss, grads = value_and_grad(params, batch)
    if naive:  # its loss is a mean of micro-batch losses: not comparable.
      loss = model.loss(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def make_steps(k: int, optimizer) -> dict[str, Any]:
  """The three train steps, by run."""
  value_and_grads = {
      "full_batch": jax.value_and_grad(model.loss),
      "coupled": oa.coupled_value_and_grad(
          model.encode, model.info_nce, num_microbatches=k),
      # Micro-batches of equal size weigh the same; the loss couples them.
      "naive": oa.value_and_grad(model.loss, num_microbatches=k,
                                 equal_weights=True),
  }
  return {run: make_step(vg, optimizer, naive=run == "naive")
          for run, vg in value_and_grads.items()}


def max_param_diff(params, reference) -> jax.Array:
  return max(jnp.max(jnp.abs(p - r)) for p, r in zip(
      jax.tree.leaves(params), jax.tree.leaves(reference)))


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Trains the three runs; returns their losses, accuracies and gaps."""
  start = time.perf_counter()
  train_images, held_out = data.split_held_out(data.load_digits(),
                                               args.held_out)
  eval_views = jax.tree.map(jnp.asarray, data.two_views(held_out, seed=1))
  sizes = (data.SIDE * data.SIDE,) + (args.hidden,) * args.layers + (args.dim,)
  optimizer = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps))
  steps = make_steps(args.k, optimizer)
  params = {run: model.init_params(args.seed, sizes) for run in RUNS}
  opt_states = {run: optimizer.init(params[run]) for run in RUNS}
  accuracy = jax.jit(model.retrieval_accuracy)

  losses = {run: [] for run in RUNS}
  param_diffs = {"coupled": [], "naive": []}
  eval_steps, accuracies = [], {run: [] for run in RUNS}
  if not args.quiet:
    print("Compiling the train steps of the three runs (a few seconds) ...",
          flush=True)
  progress = tqdm.trange(args.steps, disable=args.quiet, desc="compiling",
                         unit="step")
  batches = data.batches(train_images, args.batch_size, args.steps,
                         args.seed)
  for step, batch in zip(progress, batches):
    batch = jax.tree.map(jnp.asarray, batch)
    for run in RUNS:
      params[run], opt_states[run], loss = steps[run](
          params[run], opt_states[run], batch)
      losses[run].append(loss)
    for run in param_diffs:
      param_diffs[run].append(max_param_diff(params[run],
                                             params["full_batch"]))
    if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
      eval_steps.append(step + 1)
      for run in RUNS:
        accuracies[run].append(accuracy(params[run], eval_views))
      progress.set_postfix({f"top-1{LABELS[run][:3]}":
                            f"{float(accuracies[run][-1]):.3f}"
                            for run in RUNS})
    if step == 0:
      progress.set_description("training")

  to_numpy = lambda d: {r: np.asarray(jax.device_get(v)) for r, v in d.items()}
  losses, param_diffs = to_numpy(losses), to_numpy(param_diffs)
  accuracies = to_numpy(accuracies)
  return {
      "steps": args.steps, "k": args.k, "batch_size": args.batch_size,
      "held_out": len(held_out),
      "losses": losses,
      "final_loss": {run: float(v[-10:].mean()) for run, v in losses.items()},
      "eval_steps": np.asarray(eval_steps),
      "accuracies": accuracies,
      "final_accuracy": {run: float(v[-1]) for run, v in accuracies.items()},
      "param_diffs": param_diffs,
      "max_param_diff": {run: float(v.max()) for run, v in param_diffs.items()},
      "seconds": time.perf_counter() - start,
  }
