"""The three runs, from the same initialisation and on the same batches.

(a) full batch: one gradient of the whole batch per optimizer step;
(b) optax_accum: ``k`` micro-batches, one ``optimizer.update(model, grads,
    num_tokens=n)`` call each, with ``oa.accumulate`` in an
    ``oa.AccumulatingOptimizer`` (an ``nnx.Optimizer`` that applies the
    update only on the call that emits);
(c) naive: the same micro-batches through ``optax.MultiSteps``, which averages
    the micro-batches' mean-loss gradients (a "mean of means").

All three use the same optimizer, :func:`make_optimizer`.
"""

import argparse
import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import optax_accum as oa

import data
import model as model_lib

RUNS = ("full_batch", "accumulate", "naive")
LABELS = {
    "full_batch": "(a) full batch",
    "accumulate": "(b) oa.accumulate, k micro-batches",
    "naive": "(c) naive mean of means (optax.MultiSteps)",
}


def make_optimizer(num_steps: int, learning_rate: float):
  """Warm-up + cosine decay, global-norm clipping and AdamW."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=learning_rate,
      warmup_steps=max(num_steps // 10, 1),
      decay_steps=num_steps,
      end_value=learning_rate / 10,
  )
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b2=0.98, weight_decay=0.1),
  )


# graph=False ("tree mode") keeps nnx.jit's per-call Python overhead low; this
# model shares no Variables between modules, so it needs no graph mode.
@nnx.jit(graph=False)
def full_batch_step(model, optimizer, batch):
  """(a) One optimizer step on the gradient of the whole batch."""
  loss, grads = nnx.value_and_grad(model_lib.loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit(static_argnames="token_weighted", graph=False)
def micro_step(model, optimizer, microbatch, *, token_weighted):
  """(b), (c) One micro-batch: its gradient goes to the optimizer.

  The optimizer only changes the parameters on the ``k``-th call of a cycle:
  until then ``oa.accumulate`` (and ``optax.MultiSteps``) return zero updates.
  """
  loss, grads = nnx.value_and_grad(model_lib.loss_fn)(model, microbatch)
  num_tokens = microbatch["mask"].sum()
  if token_weighted:
    # The one line that makes accumulation exact: the micro-batch's weight.
    optimizer.update(model, grads, num_tokens=num_tokens)
  else:
    optimizer.update(model, grads)
  return loss, num_tokens


@nnx.jit(graph=False)
def max_param_diff(model, reference):
  """max |p - p_ref| over all parameters."""
  diffs = jax.tree.map(
      lambda p, r: jnp.max(jnp.abs(p - r)),
      nnx.state(model, nnx.Param),
      nnx.state(reference, nnx.Param),
  )
  return jnp.max(jnp.stack(jax.tree.leaves(diffs)))


@nnx.jit(graph=False)
def eval_loss(model, batch):
  return model_lib.loss_fn(model, batch)


def make_runs(args: argparse.Namespace) -> tuple[dict, dict]:
  """The three runs' models (equal at the start) and optimizers."""
  models = {
      run: model_lib.Transformer(
          vocab_size=data.VOCAB_SIZE, seq_len=args.seq_len, dim=args.dim,
          num_heads=args.heads, num_layers=args.layers,
          rngs=nnx.Rngs(args.seed))
      for run in RUNS
  }
  tx = make_optimizer(args.steps, args.lr)
  inner = {
      "full_batch": tx,
      "accumulate": oa.accumulate(tx, every_k=args.k),
      "naive": optax.MultiSteps(tx, every_k_schedule=args.k),
  }
  optimizers = {
      run: (oa.AccumulatingOptimizer if run == "accumulate" else
            nnx.Optimizer)(models[run], inner[run], wrt=nnx.Param)
      for run in RUNS}
  return models, optimizers


def train_step(models, optimizers, batch, k: int) -> dict[str, jax.Array]:
  """One optimizer step of each run on ``batch``; returns their losses.

  Each loss is the token-weighted loss of the whole batch (the full-batch
  objective, at each run's parameters before its update), comparable across
  runs.
  """
  losses = {"full_batch": full_batch_step(
      models["full_batch"], optimizers["full_batch"], batch)}
  for run in ("accumulate", "naive"):
    weighted_sum, total_tokens = 0.0, 0.0
    for microbatch in data.microbatches(batch, k):
      loss, num_tokens = micro_step(
          models[run], optimizers[run], microbatch,
          token_weighted=run == "accumulate")
      weighted_sum += loss * num_tokens
      total_tokens += num_tokens
    losses[run] = weighted_sum / total_tokens
  return losses


def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
  """Trains the three runs; returns their losses and parameter gaps."""
  start = time.perf_counter()
  train_verses, held_out = data.split_held_out(data.load_verses())
  train_data = data.encode(train_verses, args.seq_len, args.seed)
  eval_batch = data.encode(held_out[:256], args.seq_len, args.seed + 1)
  models, optimizers = make_runs(args)

  history = {run: [] for run in RUNS}
  param_diffs = {"accumulate": [], "naive": []}
  micro_token_counts = []
  if not args.quiet:
    # The first step traces and compiles the train steps of the three runs.
    print("Compiling the train steps of the three runs (about 20 s on 2 CPU"
          " cores with the defaults) ...", flush=True)
  progress = tqdm.trange(args.steps, disable=args.quiet, desc="compiling",
                         unit="step")
  batches = data.batches(train_data, args.batch_size, args.steps, args.seed,
                         args.group_by_length)
  for step, batch in zip(progress, batches):
    for run, loss in train_step(models, optimizers, batch, args.k).items():
      history[run].append(loss)
    assert oa.has_updated(optimizers["accumulate"].opt_state)
    micro_token_counts.append(
        [mb["mask"].sum() for mb in data.microbatches(batch, args.k)])
    for run in param_diffs:
      param_diffs[run].append(
          max_param_diff(models[run], models["full_batch"]))
    if step == 0:
      progress.set_description("training")
    if step % 25 == 0 or step == args.steps - 1:
      progress.set_postfix({
          f"loss{LABELS[run][:3]}": f"{float(history[run][-1]):.3f}"
          for run in RUNS})

  history = {run: np.asarray(jax.device_get(h)) for run, h in history.items()}
  param_diffs = {run: np.asarray(jax.device_get(d))
                 for run, d in param_diffs.items()}
  accum_state = oa.find_accumulate_state(optimizers["accumulate"].opt_state)
  return {
      "steps": args.steps,
      "k": args.k,
      "optimizer_updates": int(accum_state.count),
      "losses": history,
      "final_loss": {run: float(h[-10:].mean()) for run, h in history.items()},
      "held_out_loss": {run: float(eval_loss(models[run], eval_batch))
                        for run in RUNS},
      "param_diffs": param_diffs,
      "max_param_diff": {run: float(d.max()) for run, d in param_diffs.items()},
      "final_param_diff": {run: float(d[-1]) for run, d in param_diffs.items()},
      "microbatch_tokens_mean": np.asarray(micro_token_counts).mean(0),
      "seconds": time.perf_counter() - start,
  }
