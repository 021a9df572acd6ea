"""Two runs on the same micro-batches: a fixed k, and k set by the noise scale.

Both use ``oa.accumulate(..., with_stats=True)`` inside an ``nnx.Optimizer``
and read the gradient noise scale of every update with ``oa.grad_stats``.
Both end their cycles with ``emit=True``: the fixed run after ``k``
micro-batches, the adaptive run once the cycle's tokens reach the smoothed
noise scale, McCandlish et al.'s estimate of the critical batch size. (One
optimizer and one compiled micro-step serve both runs.)

The model and the data are those of ``examples/train_lm/``.
"""

import argparse
import importlib.util
import math
import pathlib
import time
from typing import Any, NamedTuple

from flax import nnx
import numpy as np
import optax
import tqdm

import optax_accum as oa

RUNS = ("fixed", "adaptive")
TRAIN_LM = pathlib.Path(__file__).parents[1] / "train_lm"


def _import_from_train_lm(name: str):
  """``examples/train_lm/<name>.py``, under a name no other example uses."""
  spec = importlib.util.spec_from_file_location(
      f"train_lm_{name}", TRAIN_LM / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


data = _import_from_train_lm("data")
model_lib = _import_from_train_lm("model")


def make_optimizer(learning_rate: float, warmup: int):
  """AdamW after clipping, accumulated, with the noise statistics kept.

  ``every_k=None``: every cycle ends where :func:`micro_step` passes
  ``emit=True``, after ``k`` micro-batches or once the tokens reach the
  target.
  """
  schedule = optax.linear_schedule(0.0, learning_rate, warmup)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b2=0.98, weight_decay=0.1))
  return oa.accumulate(tx, every_k=None, with_stats=True)


@nnx.jit(graph=False)
def micro_step(model, optimizer, microbatch, target_tokens, max_k):
  """One micro-batch; returns its loss, its tokens and whether it emitted.

  The cycle ends when its tokens, this micro-batch's included, reach
  ``target_tokens`` (after at least two micro-batches, the fewest the
  estimate needs) or after ``max_k`` micro-batches.
  """
  loss, grads = nnx.value_and_grad(model_lib.loss_fn)(model, microbatch)
  num_tokens = microbatch["mask"].sum()
  cycle = oa.find_accumulate_state(optimizer.opt_state)
  micro_steps = cycle.micro_step + 1
  emit = (micro_steps >= max_k) | (
      (micro_steps >= 2) & (cycle.token_count + num_tokens >= target_tokens))
  optimizer.update(model, grads, num_tokens=num_tokens, emit=emit)
  return loss, num_tokens, oa.has_updated(optimizer.opt_state)


@nnx.jit(graph=False)
def eval_loss(model, batch):
  return model_lib.loss_fn(model, batch)


class Smoothed(NamedTuple):
  """Bias-corrected exponential moving averages of the two estimates."""

  grad_sq_norm: float
  trace_cov: float
  weight: float  # 1 - decay^updates: the bias correction.

  def noise_scale(self) -> float:
    if self.weight == 0:
      return math.nan
    return self.trace_cov / self.grad_sq_norm


def smooth(avg: Smoothed, stats: Any, decay: float) -> Smoothed:
  """McCandlish et al. average |G|^2 and tr(Sigma), then take the ratio."""
  if not math.isfinite(float(stats.noise_scale)):
    return avg
  w = avg.weight * decay + (1 - decay)
  mix = lambda old, new: (old * avg.weight * decay + (1 - decay) * new) / w
  return Smoothed(mix(avg.grad_sq_norm, float(stats.grad_sq_norm)),
                  mix(avg.trace_cov, float(stats.trace_cov)), w)


def train_run(run: str, args: argparse.Namespace, tx, microbatches: list,
              progress: tqdm.tqdm) -> dict[str, Any]:
  """Trains one run over ``microbatches``; returns its per-update history."""
  model = model_lib.Transformer(
      vocab_size=data.VOCAB_SIZE, seq_len=args.seq_len, dim=args.dim,
      num_heads=args.heads, num_layers=args.layers, rngs=nnx.Rngs(args.seed))
  adaptive = run == "adaptive"
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  avg = Smoothed(0.0, 0.0, 0.0)
  # The first cycle has k micro-batches, as the fixed run's: no estimate yet.
  target, max_k = math.inf, args.k
  history = {name: [] for name in (
      "tokens", "cycle_tokens", "cycle_microbatches", "loss", "noise_scale",
      "smoothed_noise_scale", "grad_sq_norm", "trace_cov")}
  micro_losses, micro_tokens = [], []
  cycle_loss, cycle_tokens, cycle_microbatches, seen = 0.0, 0.0, 0, 0.0
  for microbatch in microbatches:
    loss, num_tokens, emitted = micro_step(
        model, optimizer, microbatch, np.float32(target), np.int32(max_k))
    loss, num_tokens = float(loss), float(num_tokens)
    progress.set_description("training")  # compiled by the first call.
    micro_losses.append(loss)
    micro_tokens.append(num_tokens)
    cycle_loss += loss * num_tokens
    cycle_tokens += num_tokens
    cycle_microbatches += 1
    seen += num_tokens
    progress.update()
    if not emitted:
      continue
    stats = oa.grad_stats(optimizer.opt_state)
    avg = smooth(avg, stats, args.ema)
    if adaptive and math.isfinite(avg.noise_scale()):
      target, max_k = max(avg.noise_scale(), 1.0), args.max_k
    for name, value in (
        ("tokens", seen), ("cycle_tokens", cycle_tokens),
        ("cycle_microbatches", cycle_microbatches),
        ("loss", cycle_loss / max(cycle_tokens, 1.0)),
        ("noise_scale", float(stats.noise_scale)),
        ("smoothed_noise_scale", avg.noise_scale()),
        ("grad_sq_norm", float(stats.grad_sq_norm)),
        ("trace_cov", float(stats.trace_cov))):
      history[name].append(value)
    cycle_loss, cycle_tokens, cycle_microbatches = 0.0, 0.0, 0
    progress.set_postfix(run=run, loss=f"{history['loss'][-1]:.3f}",
                         B=f"{avg.noise_scale():.0f}")
  out = {name: np.asarray(values) for name, values in history.items()}
  out["smoothed_loss"] = trailing_loss(
      np.asarray(micro_losses), np.asarray(micro_tokens),
      np.cumsum(micro_tokens), out["tokens"], args.loss_window)
  out["updates"] = int(oa.find_accumulate_state(optimizer.opt_state).count)
  out["model"] = model
  return out


def trailing_loss(losses, tokens, ends, at, window):
  """The token-weighted loss of the micro-batches of the last ``window``
  tokens before each of ``at`` (cumulative token counts)."""
  out = []
  for end in at:
    last = np.searchsorted(ends, end, side="right")
    first = np.searchsorted(ends, end - window, side="right")
    first = min(first, last - 1)
    n = tokens[first:last]
    out.append(float((losses[first:last] * n).sum() / max(n.sum(), 1.0)))
  return np.asarray(out)


def first_reaching(history: dict[str, np.ndarray], target: float):
  """(updates, tokens) when the smoothed loss first reaches ``target``."""
  below = np.flatnonzero(history["smoothed_loss"] <= target)
  if not len(below):
    return None, None
  return int(below[0]) + 1, float(history["tokens"][below[0]])


def train_and_compare(args: argparse.Namespace) -> dict[str, Any]:
  """Trains both runs on the same micro-batches; returns their histories."""
  start = time.perf_counter()
  train_verses, held_out = data.split_held_out(data.load_verses())
  train_data = data.encode(train_verses, args.seq_len, args.seed)
  eval_batch = data.encode(held_out[:256], args.seq_len, args.seed + 1)
  num_microbatches = args.steps * args.k
  # Every micro-batch is new data (one epoch at the defaults): the loss of a
  # cycle, measured before its update, is a held-out loss.
  microbatches = list(data.batches(train_data, args.microbatch_size,
                                   num_microbatches, args.seed, False))
  tx = make_optimizer(args.lr, args.warmup)
  results = {"args": vars(args)}
  progress = tqdm.tqdm(total=len(RUNS) * num_microbatches, unit="micro-step",
                       disable=args.quiet, desc="compiling")
  for run in RUNS:
    run_start = time.perf_counter()
    history = train_run(run, args, tx, microbatches, progress)
    history["seconds"] = time.perf_counter() - run_start
    history["held_out_loss"] = float(
        eval_loss(history.pop("model"), eval_batch))
    updates, tokens = first_reaching(history, args.target_loss)
    history["updates_to_target"], history["tokens_to_target"] = updates, tokens
    results[run] = history
  progress.close()
  results["seconds"] = time.perf_counter() - start
  return results
