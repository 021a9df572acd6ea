r"""Train a small byte-level transformer three ways: exact accumulation wins.

This is the example to run first. It fine-tunes a small Flax NNX decoder-only
transformer to complete verses of the King James Bible (``examples/data/``),
three times, from the same initialisation and on the same batches:

(a) **full batch**: one gradient of the whole batch per optimizer step;
(b) **optax_accum**: the batch split into ``k`` micro-batches, one
    ``optimizer.update(model, grads, num_tokens=n)`` call per micro-batch, with
    ``oa.accumulate`` inside an ``nnx.Optimizer``;
(c) **naive accumulation**: the same micro-batches through
    ``optax.MultiSteps``, which averages the micro-batches' mean-loss gradients
    (a "mean of means").

Each example is one verse, split at a random point into a prompt and a
completion; the loss is the mean next-byte cross-entropy over the completion
bytes only (the prompt and the padding are masked out), as in supervised
fine-tuning on (prompt, answer) pairs. Completions run from one byte to a whole
verse, and, as data loaders often do to save padding (``group_by_length``),
each batch is sorted by length before it is split: some micro-batches hold a
few dozen tokens, others several hundred. The full batch's loss weighs every
token the same:

.. math::
  L = \frac{\sum_i n_i L_i}{\sum_i n_i},

where micro-batch ``i`` has ``n_i`` tokens and mean loss ``L_i``. (b) computes
exactly this gradient, so it follows run (a) to float32 rounding, through the
learning-rate schedule, gradient clipping and AdamW. (c) computes
:math:`\frac1k \sum_i \nabla L_i` instead: a token of the smallest micro-batch
weighs over ten times more than a token of the largest. It optimizes another
objective, drifts away from (a) and ends with a higher loss.

Run it::

  python examples/train_lm.py     # 1 to 2 minutes on 2 CPU cores
  python examples/train_lm.py --k 4 --steps 300 --out /tmp/lm.png

It prints a summary table and saves a plot of the three runs' losses.
"""

import argparse
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

import optax_accum as oa

DATA_PATH = pathlib.Path(__file__).parent / "data" / "kjv_verses.txt"
VOCAB_SIZE = 128  # ASCII bytes; the corpus is plain ASCII.
PAD, BOS, EOS = 0, 1, ord("\n")


# ----------------------------------------------------------------------------
# Data: one verse per sequence, right-padded, with a mask of the real tokens.
# ----------------------------------------------------------------------------


def load_verses(path: pathlib.Path = DATA_PATH) -> list[bytes]:
  """The verses of the corpus, one ``bytes`` each (the reference is dropped)."""
  lines = path.read_text(encoding="ascii").splitlines()
  return [line.split("\t", 1)[1].encode("ascii") for line in lines]


def encode(
    verses: Sequence[bytes], seq_len: int, seed: int
) -> dict[str, np.ndarray]:
  """Verse-completion arrays for ``verses``, padded to ``seq_len``.

  Sequence ``BOS verse EOS`` is cut to ``seq_len + 1`` bytes; ``inputs`` are all
  but its last byte and ``targets`` all but its first. Each verse is split at a
  random point into a prompt and a completion, and ``mask`` is 1 exactly on the
  completion's targets, as when fine-tuning on (prompt, answer) pairs: the
  completions, hence the tokens that count, range from 1 byte to a whole verse.
  """
  rng = np.random.default_rng(seed)
  inputs = np.full((len(verses), seq_len), PAD, np.int32)
  targets = np.full((len(verses), seq_len), PAD, np.int32)
  mask = np.zeros((len(verses), seq_len), np.float32)
  for row, verse in enumerate(verses):
    seq = np.frombuffer(bytes([BOS]) + verse + bytes([EOS]), np.uint8)
    seq = seq[: seq_len + 1]
    inputs[row, : len(seq) - 1] = seq[:-1]
    targets[row, : len(seq) - 1] = seq[1:]
    prompt_len = rng.integers(1, len(seq) - 1, endpoint=True)
    mask[row, prompt_len - 1 : len(seq) - 1] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def batches(
    data: dict[str, np.ndarray],
    batch_size: int,
    num_steps: int,
    seed: int,
    group_by_length: bool,
):
  """Yields ``num_steps`` batches, epoch by epoch in a seeded random order."""
  rng = np.random.default_rng(seed)
  num_rows = len(data["inputs"])
  order = np.empty(0, np.int64)
  for _ in range(num_steps):
    if len(order) < batch_size:
      order = np.concatenate([order, rng.permutation(num_rows)])
    rows, order = order[:batch_size], order[batch_size:]
    if group_by_length:
      # Fewest tokens first: micro-batch 0 gets the shortest completions.
      rows = rows[np.argsort(data["mask"][rows].sum(1), kind="stable")]
    yield {name: array[rows] for name, array in data.items()}


def microbatches(batch: dict[str, Any], k: int) -> list[dict[str, Any]]:
  """Splits ``batch`` into ``k`` consecutive micro-batches of equal size."""
  size = len(batch["inputs"]) // k
  return [
      {name: array[i * size : (i + 1) * size] for name, array in batch.items()}
      for i in range(k)
  ]


# ----------------------------------------------------------------------------
# Model: a small pre-LayerNorm decoder-only transformer.
# ----------------------------------------------------------------------------


class Block(nnx.Module):
  """Causal self-attention and an MLP, each with a residual connection."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=dim, use_bias=False, decode=False,
        rngs=rngs
    )
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """Byte embeddings, learned positions, ``num_layers`` blocks, logits."""

  def __init__(
      self, *, seq_len: int, dim: int, num_heads: int, num_layers: int,
      rngs: nnx.Rngs,
  ):
    self.embed = nnx.Embed(VOCAB_SIZE, dim, rngs=rngs)
    self.positions = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (seq_len, dim))
    )
    self.blocks = nnx.List(
        [Block(dim, num_heads, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.unembed = nnx.Linear(dim, VOCAB_SIZE, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.positions[...]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.unembed(self.final_norm(x))


def loss_fn(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean next-byte cross-entropy over the unmasked (completion) tokens."""
  logits = model(batch["inputs"])
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]
  )
  mask = batch["mask"]
  return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


# ----------------------------------------------------------------------------
# Training steps. All three runs use the same optimizer, `make_optimizer`.
# ----------------------------------------------------------------------------


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
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit(static_argnames="token_weighted", graph=False)
def micro_step(model, optimizer, microbatch, *, token_weighted):
  """(b), (c) One micro-batch: its gradient goes to the optimizer.

  The optimizer only changes the parameters on the ``k``-th call of a cycle:
  until then ``oa.accumulate`` (and ``optax.MultiSteps``) return zero updates.
  """
  loss, grads = nnx.value_and_grad(loss_fn)(model, microbatch)
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
  return loss_fn(model, batch)


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------

RUNS = ("full_batch", "accumulate", "naive")
LABELS = {
    "full_batch": "(a) full batch",
    "accumulate": "(b) oa.accumulate, k micro-batches",
    "naive": "(c) naive mean of means (optax.MultiSteps)",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=150,
                      help="optimizer steps (full batches) per run")
  parser.add_argument("--k", type=int, default=8,
                      help="micro-batches per batch for runs (b) and (c)")
  parser.add_argument("--batch-size", type=int, default=32,
                      help="sequences per full batch")
  parser.add_argument("--seq-len", type=int, default=128,
                      help="bytes per padded sequence")
  parser.add_argument("--dim", type=int, default=48, help="model width")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="peak learning rate")
  parser.add_argument("--group-by-length",
                      action=argparse.BooleanOptionalAction, default=True,
                      help="sort each batch by token count before splitting")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="train_lm.png",
                      help="where to save the plot ('' for no plot)")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress bar or table")
  args = parser.parse_args(argv)
  if args.batch_size % args.k:
    parser.error(f"--batch-size {args.batch_size} must be divisible by"
                 f" --k {args.k}.")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the three trainings; returns their losses and parameter gaps."""
  args = parse_args(argv)
  start = time.perf_counter()

  verses = load_verses()
  held_out = verses[::20]  # every 20th verse, never trained on
  train = [v for i, v in enumerate(verses) if i % 20]
  train_data = encode(train, args.seq_len, args.seed)
  eval_batch = encode(held_out[:256], args.seq_len, args.seed + 1)

  def new_model():  # the same initial parameters for every run
    return Transformer(seq_len=args.seq_len, dim=args.dim,
                       num_heads=args.heads, num_layers=args.layers,
                       rngs=nnx.Rngs(args.seed))

  tx = make_optimizer(args.steps, args.lr)
  models = {run: new_model() for run in RUNS}
  optimizers = {
      "full_batch": nnx.Optimizer(models["full_batch"], tx, wrt=nnx.Param),
      "accumulate": nnx.Optimizer(
          models["accumulate"], oa.accumulate(tx, every_k=args.k),
          wrt=nnx.Param),
      "naive": nnx.Optimizer(
          models["naive"], optax.MultiSteps(tx, every_k_schedule=args.k),
          wrt=nnx.Param),
  }

  # Per step: the token-weighted loss of the whole batch (each run's params
  # before its update), i.e. the full-batch objective, comparable across runs.
  history = {run: [] for run in RUNS}
  param_diffs = {"accumulate": [], "naive": []}
  micro_token_counts = []
  data = batches(train_data, args.batch_size, args.steps, args.seed,
                 args.group_by_length)
  progress = tqdm.trange(args.steps, disable=args.quiet, desc="training",
                         unit="step")
  for step in progress:
    batch = next(data)
    history["full_batch"].append(
        full_batch_step(models["full_batch"], optimizers["full_batch"], batch))

    for run in ("accumulate", "naive"):
      weighted_sum, total_tokens = 0.0, 0.0
      for microbatch in microbatches(batch, args.k):
        loss, num_tokens = micro_step(
            models[run], optimizers[run], microbatch,
            token_weighted=run == "accumulate")
        weighted_sum += loss * num_tokens
        total_tokens += num_tokens
      history[run].append(weighted_sum / total_tokens)
    assert oa.has_updated(optimizers["accumulate"].opt_state)
    micro_token_counts.append([mb["mask"].sum()
                               for mb in microbatches(batch, args.k)])

    for run in param_diffs:
      param_diffs[run].append(
          max_param_diff(models[run], models["full_batch"]))
    if step % 25 == 0 or step == args.steps - 1:
      progress.set_postfix({
          "loss(a)": f"{float(history['full_batch'][-1]):.3f}",
          "loss(b)": f"{float(history['accumulate'][-1]):.3f}",
          "loss(c)": f"{float(history['naive'][-1]):.3f}",
      })

  history = {run: np.asarray(jax.device_get(h)) for run, h in history.items()}
  param_diffs = {run: np.asarray(jax.device_get(d))
                 for run, d in param_diffs.items()}
  held_out_loss = {run: float(eval_loss(models[run], eval_batch))
                   for run in RUNS}
  accum_state = oa.find_accumulate_state(optimizers["accumulate"].opt_state)
  tokens = np.asarray(micro_token_counts)
  results = {
      "steps": args.steps,
      "k": args.k,
      "optimizer_updates": int(accum_state.count),
      "losses": history,
      "final_loss": {run: float(h[-10:].mean()) for run, h in history.items()},
      "held_out_loss": held_out_loss,
      "param_diffs": param_diffs,
      "max_param_diff": {run: float(d.max()) for run, d in param_diffs.items()},
      "final_param_diff": {run: float(d[-1]) for run, d in param_diffs.items()},
      "microbatch_tokens_mean": tokens.mean(0),
      "seconds": time.perf_counter() - start,
  }
  if not args.quiet:
    print_summary(results)
  if args.out:
    results["plot"] = plot(results, args)
    if not args.quiet:
      print(f"Plot saved to {results['plot']}")
  return results


def print_summary(results: dict[str, Any]) -> None:
  counts = ", ".join(f"{n:.0f}" for n in results["microbatch_tokens_mean"])
  print(f"\n{results['steps']} steps, k={results['k']} micro-batches of"
        f" {counts} tokens on average ({results['seconds']:.0f} s)\n")
  header = (f"{'run':<44} {'train loss':>10} {'held-out':>9}"
            f" {'max |param - (a)|':>18}")
  print(header)
  print("-" * len(header))
  for run in RUNS:
    diff = results["max_param_diff"].get(run, 0.0)
    print(f"{LABELS[run]:<44} {results['final_loss'][run]:>10.4f}"
          f" {results['held_out_loss'][run]:>9.4f} {diff:>18.2e}")
  print("(train loss: token-weighted loss of the last 10 batches)")


def plot(results: dict[str, Any], args: argparse.Namespace) -> str:
  """Saves the loss curves, their gaps to (a) and the parameter gaps to (a)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  steps = np.arange(1, results["steps"] + 1)
  losses = results["losses"]
  fig, (top, middle, bottom) = plt.subplots(
      3, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 2, 2))
  styles = {
      "full_batch": dict(color="black", lw=3.5, alpha=0.3),
      "accumulate": dict(color="tab:blue", lw=1.2, ls="--"),
      "naive": dict(color="tab:red", lw=1.0),
  }
  for run in RUNS:
    top.plot(steps, losses[run], label=LABELS[run], **styles[run])
  # Zoom past the first steps, where all runs fall from the same high loss.
  late = losses["full_batch"][len(steps) // 5 :]
  spread = late.max() - late.min()
  top.set_ylim(min(h.min() for h in losses.values()) - 0.1 * spread,
               late.max() + 0.5 * spread)
  top.set_ylabel("loss of the full batch\n(per completion token)")
  top.set_title(
      f"Byte-level transformer, batch {args.batch_size} verses,"
      f" k={args.k} micro-batches of uneven token counts")
  top.legend()
  top.grid(alpha=0.3)

  middle.axhline(0.0, color="black", lw=0.8)
  for run in ("accumulate", "naive"):
    gap = losses[run] - losses["full_batch"]
    middle.plot(steps, gap, color=styles[run]["color"], lw=1.0,
                alpha=0.5 if run == "naive" else 1.0, label=LABELS[run])
  window = max(len(steps) // 15, 1)
  naive_gap = losses["naive"] - losses["full_batch"]
  smooth = np.convolve(naive_gap, np.ones(window) / window, mode="valid")
  middle.plot(steps[window - 1 :], smooth, color="tab:red", lw=2.0,
              label=f"(c), mean over {window} steps")
  middle.set_ylabel("loss - loss of (a)")
  middle.legend(fontsize="small", loc="upper left")
  middle.grid(alpha=0.3)

  for run in ("accumulate", "naive"):
    bottom.plot(steps, np.maximum(results["param_diffs"][run], 1e-10),
                color=styles[run]["color"], label=LABELS[run])
  bottom.set_yscale("log")
  bottom.set_ylabel("max |param - param of (a)|")
  bottom.set_xlabel("optimizer step")
  bottom.legend(fontsize="small")
  bottom.grid(alpha=0.3)
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return str(out)


if __name__ == "__main__":
  main()
