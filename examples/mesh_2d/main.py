r"""Data x model parallelism on a 2-D mesh, exactly equal to the full batch.

A two-layer MLP is trained on a ``data`` x ``model`` mesh (4 x 2 simulated CPU
devices): the batch is split over ``data``, the weights over ``model``
(Megatron-style). ``oa.value_and_grad(..., axis_name="data")`` runs ``--k``
micro-batches per device and sums the gradient over ``data`` once, after the
loop. The script checks the losses and parameters against one device on the
whole batch, and prints the compiled step's collectives by mesh axis and
place. See README.md.

Run it from the repository root::

  python examples/mesh_2d/main.py
  python examples/mesh_2d/main.py --k 4 --steps 10 --axis-types explicit
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
                      help=f"global batch (sequences), split over the"
                      f" {train.DATA} devices of the data axis")
  parser.add_argument("--steps", type=int, default=3,
                      help="optimizer steps (AdamW) per run")
  parser.add_argument("--lr", type=float, default=0.02, help="learning rate")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data and the initialisation")
  parser.add_argument("--axis-types", choices=("auto", "explicit"),
                      default="auto",
                      help="the mesh axes' types (jax.sharding.AxisType)")
  args = parser.parse_args(argv)
  if args.batch % (train.DATA * args.k):
    parser.error(f"--batch {args.batch} must be divisible by {train.DATA}"
                 f" data devices x --k {args.k}.")
  return args


def _by_place(by_axes, axes, place) -> str:
  counts = getattr(by_axes[axes], place) if axes in by_axes else {}
  return ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"


def _label(axes: tuple[str, ...]) -> str:
  return "+".join(axes) or "none"  # (): groups of one device each.


def print_report(results: dict[str, Any]) -> None:
  print(f"{'step':>4} {'2-D mesh loss':>14} {'1 device loss':>14}")
  for i, (a, b) in enumerate(
      zip(results["losses"], results["reference_losses"])):
    print(f"{i:>4} {a:>14.6f} {b:>14.6f}")
  print(f"max |grad - full batch grad|     {results['grad_max_abs_diff']:.2e}")
  print(f"max |params - 1 device params|   {results['param_max_abs_diff']:.2e}")
  print(f"gradient shardings               {results['grad_specs']}")
  print("\nCollectives of one compiled train step, by the mesh axis they run"
        " over\n(oa.count_collectives(compiled, mesh=mesh).by_axes):\n")
  rows = [("optax_accum", results["collectives_by_axis"]),
          ("naive lax.scan", results["naive_collectives_by_axis"])]
  keys = sorted({axes for _, by_axes in rows for axes in by_axes},
                key=lambda axes: (len(axes), axes))
  print(f"{'':<16}{'axis':<7}{'in the micro-batch loop':<30}after the loop")
  for name, by_axes in rows:
    for axes in keys:
      print(f"{name:<16}{_label(axes):<7}"
            f"{_by_place(by_axes, axes, 'in_loop'):<30}"
            f"{_by_place(by_axes, axes, 'outside')}")
      name = ""
  print(
      "\nThe all-reduce over 'model' in the loop is the model's own: the"
      " row-parallel\nsecond layer sums its two halves on every forward pass"
      " (the same loop on a\n1 x 2 mesh, with no data axis, has"
      f" {results['model_only_collectives'].in_loop} too). Over 'data',\n"
      "optax_accum sums the gradient once, after the loop; the naive loop sums"
      " it on\nevery micro-batch.")
  model_outside = results["collectives_by_axis"].get(("model",))
  if model_outside and "all-gather" in model_outside.outside:
    print("With Explicit axes, jax also all-gathers the 'model'-sharded"
          " parameters and\ngradients at the boundary of the shard_map that"
          " runs the loop: once per step,\noutside the loop.")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains on the 2-D mesh and on one device; returns both and the counts."""
  args = parse_args(argv)
  results = train.train_and_compare(args)
  print_report(results)
  return results


if __name__ == "__main__":
  # Eight simulated CPU devices; must be set before jax starts its backends.
  jax.config.update("jax_num_cpu_devices", train.DATA * train.MODEL)
  main()
