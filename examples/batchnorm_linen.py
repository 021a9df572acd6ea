"""BatchNorm under micro-batching: a Flax linen TrainState recipe.

A small convnet with BatchNorm learns the 8x8 handwritten digits of
``examples/data/digits.npz``. The train step computes the gradient of each batch
in ``k`` micro-batches with ``oa.value_and_grad(..., has_state=True)``, which
threads the model state (``batch_stats``) from one micro-batch to the next::

  (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats, batch)
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)

What BatchNorm does under micro-batching
----------------------------------------
In training, BatchNorm normalizes each activation with the mean and variance of
*the batch it is given*, and it folds those statistics into running averages
(``batch_stats``) that are used at evaluation time. Split a batch into ``k``
micro-batches and

* each micro-batch is normalized with its own statistics, over ``B / k``
  examples instead of ``B``. The loss, hence the gradient, is not the
  full-batch one: of all the layers in common use, BatchNorm is the one whose
  output for one example depends on the other examples of its batch, so no
  accumulation scheme can reproduce the full batch exactly (short of a second
  pass over the batch to compute the statistics first);
* the running averages are updated ``k`` times per optimizer step, once per
  micro-batch, in order: ``oa.value_and_grad`` hands micro-batch ``i`` the
  ``batch_stats`` that micro-batch ``i - 1`` produced, exactly as if the
  micro-batches had been run one after the other.

Why that is usually fine, and what to do:

* Normalizing over smaller groups is "ghost batch normalization" (Hoffer et al,
  `Train longer, generalize better <https://arxiv.org/abs/1705.08741>`_, 2017):
  it tends to regularize rather than hurt, as long as a micro-batch holds
  enough examples for its statistics to mean something (say 16 or more per
  device). This example trains as well with ``k`` micro-batches as with the
  full batch.
* ``k`` updates per step shorten the running averages' memory in steps. To keep
  the memory of a full-batch run with momentum ``m``, use ``m ** (1 / k)``
  (``--match-momentum``, on by default).
* If the result must match the full batch exactly, normalize per example:
  GroupNorm or LayerNorm have no batch dependence, and accumulation is then
  exact. This script trains a GroupNorm twin of the network to show it.

Run it::

  python examples/batchnorm_linen.py            # about 25 s on 2 CPU cores
  python examples/batchnorm_linen.py --k 8 --batch-size 128
"""

import argparse
from collections.abc import Sequence
import pathlib
import time
from typing import Any

from flax import linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_accum as oa

DATA_PATH = pathlib.Path(__file__).parent / "data" / "digits.npz"


def load_digits(seed: int) -> tuple[dict, dict]:
  """(train, test) splits of the 1797 digits: images in [0, 1], labels 0-9."""
  with np.load(DATA_PATH) as data:
    images = data["images"].astype(np.float32)[..., None] / 16.0
    labels = data["labels"].astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  test, train = order[:297], order[297:]
  return ({"image": images[train], "label": labels[train]},
          {"image": images[test], "label": labels[test]})


class ConvNet(nn.Module):
  """Two conv layers, each normalized, then global average pooling."""

  norm: str = "batch"  # "batch" (BatchNorm) or "group" (GroupNorm)
  momentum: float = 0.9  # of BatchNorm's running averages

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    for features, stride in ((16, 1), (32, 2)):
      x = nn.Conv(features, (3, 3), strides=stride, use_bias=False)(x)
      if self.norm == "batch":
        x = nn.BatchNorm(use_running_average=not train,
                         momentum=self.momentum)(x)
      else:
        x = nn.GroupNorm(num_groups=4)(x)
      x = nn.gelu(x)
    return nn.Dense(10)(x.mean(axis=(1, 2)))


class TrainState(train_state.TrainState):
  batch_stats: Any  # BatchNorm's running averages ({} for GroupNorm)


def create_state(model: ConvNet, tx: optax.GradientTransformation,
                 seed: int) -> TrainState:
  variables = model.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)),
                         train=False)
  return TrainState.create(apply_fn=model.apply, params=variables["params"],
                           batch_stats=variables.get("batch_stats", {}), tx=tx)


def make_train_step(model: ConvNet, k: int):
  """A jitted step: ``k`` micro-batches, one optimizer update."""

  def loss_fn(params, batch_stats, microbatch):
    logits, new_state = model.apply(
        {"params": params, "batch_stats": batch_stats}, microbatch["image"],
        train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, microbatch["label"]).mean()
    return loss, new_state.get("batch_stats", {})

  # Micro-batches have the same number of examples, so they weigh the same
  # (equal_weights); pass num_tokens_fn when they do not (padding, masks).
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=k, has_state=True,
                              equal_weights=True)

  @jax.jit
  def train_step(state, batch):
    (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats,
                                         batch)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return state, loss

  return train_step


@jax.jit
def accuracy(state: TrainState, data: dict[str, jax.Array]) -> jax.Array:
  logits = state.apply_fn(
      {"params": state.params, "batch_stats": state.batch_stats},
      data["image"], train=False)
  return jnp.mean(jnp.argmax(logits, -1) == data["label"])


def train(norm: str, k: int, args: argparse.Namespace, train_data, test_data):
  """Trains one network; returns its final state and per-step losses."""
  momentum = args.momentum ** (1 / k) if args.match_momentum else args.momentum
  model = ConvNet(norm=norm, momentum=momentum)
  tx = optax.adamw(optax.cosine_decay_schedule(args.lr, args.steps))
  state = create_state(model, tx, args.seed)
  train_step = make_train_step(model, k)
  rng = np.random.default_rng(args.seed)  # the same batches for every run
  order = np.empty(0, np.int64)
  losses = []
  for _ in range(args.steps):
    if len(order) < args.batch_size:
      order = np.concatenate([order,
                              rng.permutation(len(train_data["label"]))])
    rows, order = order[: args.batch_size], order[args.batch_size :]
    state, loss = train_step(state, {n: a[rows] for n, a in train_data.items()})
    losses.append(loss)
  return state, np.asarray(losses), float(accuracy(state, test_data))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=200,
                      help="optimizer steps (batches) per run")
  parser.add_argument("--k", type=int, default=4,
                      help="micro-batches per batch")
  parser.add_argument("--batch-size", type=int, default=64,
                      help="images per batch")
  parser.add_argument("--lr", type=float, default=1e-2,
                      help="learning rate (AdamW)")
  parser.add_argument("--momentum", type=float, default=0.9,
                      help="BatchNorm momentum of the full-batch run")
  parser.add_argument("--match-momentum",
                      action=argparse.BooleanOptionalAction, default=True,
                      help="use momentum ** (1 / k) with k micro-batches")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialisation and the batches")
  parser.add_argument("--quiet", action="store_true",
                      help="print nothing")
  args = parser.parse_args(argv)
  if args.batch_size % args.k:
    parser.error(f"--batch-size {args.batch_size} must be divisible by"
                 f" --k {args.k}.")
  return args


def max_abs_diff(a: Any, b: Any) -> float:
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains BatchNorm and GroupNorm nets with 1 and k micro-batches.

  Returns their test accuracies, per-step losses and parameter gaps.
  """
  args = parse_args(argv)
  start = time.perf_counter()
  train_data, test_data = load_digits(args.seed)
  results: dict[str, Any] = {"k": args.k, "accuracy": {}, "losses": {},
                             "final_loss": {}, "max_param_diff": {}}
  for norm in ("batch", "group"):
    runs = {k: train(norm, k, args, train_data, test_data) for k in (1, args.k)}
    for k, (_, losses, acc) in runs.items():
      results["accuracy"][f"{norm}_norm_k{k}"] = acc
      results["losses"][f"{norm}_norm_k{k}"] = losses
      results["final_loss"][f"{norm}_norm_k{k}"] = float(losses[-20:].mean())
    results["max_param_diff"][f"{norm}_norm"] = max_abs_diff(
        runs[1][0].params, runs[args.k][0].params)
    if norm == "batch":
      results["batch_stats"] = {k: runs[k][0].batch_stats for k in runs}
  results["seconds"] = time.perf_counter() - start

  if not args.quiet:
    print(f"{'':<12}{'test accuracy':>28}{'train loss':>24}"
          f"{'max |param diff|':>20}")
    print(f"{'':<12}{'full batch':>14}{f'k={args.k}':>14}{'full batch':>12}"
          f"{f'k={args.k}':>12}{'k vs full':>20}")
    for norm in ("batch", "group"):
      acc, loss = results["accuracy"], results["final_loss"]
      print(f"{norm.capitalize() + 'Norm':<12}{acc[f'{norm}_norm_k1']:>14.3f}"
            f"{acc[f'{norm}_norm_k{args.k}']:>14.3f}"
            f"{loss[f'{norm}_norm_k1']:>12.4f}"
            f"{loss[f'{norm}_norm_k{args.k}']:>12.4f}"
            f"{results['max_param_diff'][f'{norm}_norm']:>20.2e}")
    print("BatchNorm: statistics per micro-batch, so not the full-batch run,"
          " but as accurate.\nGroupNorm: no batch dependence, so accumulation"
          f" is exact. ({results['seconds']:.0f} s)")
  return results


if __name__ == "__main__":
  main()
