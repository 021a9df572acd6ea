r"""FSDP x tensor parallelism with logical axis rules, exactly the full batch.

A small Flax NNX transformer whose parameters carry logical axes
(``nnx.with_partitioning``) is laid out on a ``data`` x ``fsdp`` x ``tensor``
mesh of 2 x 2 x 2 simulated CPU devices with Explicit axes, and trained with
``oa.value_and_grad`` under ``jax.jit`` (the data axes read off the batch's
sharding), dropout and a token-weighted loss. The script checks the gradient
against one device on the whole batch and prints the compiled step's
collectives by mesh axis, beside those of the full-batch ``jax.jit`` step.
See README.md.

Run it from the repository root::

  python examples/fsdp_tensor/main.py
  python examples/fsdp_tensor/main.py --k 4 --steps 5
"""

import argparse
from collections.abc import Sequence
from typing import Any

import jax

import train


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--k", type=int, default=2,
                      help="micro-batches per device and step")
  parser.add_argument("--batch", type=int, default=32,
                      help="global batch (sequences), split over the 4"
                      " devices of the data and fsdp axes")
  parser.add_argument("--steps", type=int, default=3,
                      help="optimizer steps (AdamW)")
  parser.add_argument("--seq-len", type=int, default=32,
                      help="bytes per (padded) sequence")
  parser.add_argument("--dim", type=int, default=64, help="model width")
  parser.add_argument("--heads", type=int, default=4,
                      help="attention heads (split over tensor)")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks")
  parser.add_argument("--dropout", type=float, default=0.1,
                      help="dropout rate during training")
  parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data and the initialisation")
  args = parser.parse_args(argv)
  if args.batch % (4 * args.k):
    parser.error(f"--batch {args.batch} must be divisible by 4 data devices"
                 f" x --k {args.k}.")
  return args


def _places(counts, place) -> str:
  found = getattr(counts, place)
  return ", ".join(f"{n} {name}" for name, n in found.items()) or "none"


def print_report(results: dict[str, Any]) -> None:
  print(f"gradient vs one device, full batch (dropout off, {results['tokens']}"
        " tokens):")
  print(f"  |loss - full batch loss|       {results['loss_diff']:.2e}")
  print(f"  max |grad - full batch grad|   {results['grad_max_abs_diff']:.2e}")
  print("  gradients sharded like the parameters:"
        f" {results['grads_sharded_like_params']}"
        f" ({', '.join(results['grad_specs'])})")
  print("\ntraining with dropout: losses "
        + " ".join(f"{loss:.4f}" for loss in results["losses"]))
  print("\nCollectives of one compiled train step, by the mesh axes they run"
        " over\n(oa.count_collectives(compiled, mesh=mesh).by_axes):\n")
  print(f"{'axes':<18}{'in the micro-batch loop':<34}{'after the loop':<34}"
        "full-batch jax.jit step")
  full = results["full_batch_collectives"].by_axes
  for axes in sorted(set(results["collectives"].by_axes) | set(full),
                     key=lambda a: (len(a), a)):
    counts = results["collectives"].by_axes.get(axes)
    print(f"{'+'.join(axes) or 'none':<18}"
          f"{_places(counts, 'in_loop') if counts else 'none':<34}"
          f"{_places(counts, 'outside') if counts else 'none':<34}"
          f"{_places(full[axes], 'total') if axes in full else 'none'}")
  report = results["report"]
  print(f"\nKept replicated, reduced in each micro-batch (oa.sharding_report):"
        f" {len(report.fallback_leaves)} leaves,"
        f" {report.fallback_share:.1%} of the gradient's bytes:")
  for leaf in report.fallback_leaves:
    print(f"  {leaf}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Checks the gradient, trains, prints; returns the results."""
  args = parse_args(argv)
  results = train.run(args)
  print_report(results)
  return results


if __name__ == "__main__":
  # Eight simulated CPU devices; must be set before jax starts its backends.
  jax.config.update("jax_num_cpu_devices", 8)
  main()
