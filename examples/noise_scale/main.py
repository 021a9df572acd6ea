r"""How big should the batch be? Measure the gradient noise scale as you train.

Trains the small byte-level transformer of ``examples/train_lm/`` on King James
Bible verses twice, on the same micro-batches, with
``oa.accumulate(..., with_stats=True)``: once with a fixed ``k``, once ending
each cycle with ``emit=True`` when its tokens reach the smoothed gradient
noise scale (``oa.grad_stats``). Prints the updates and tokens each needs to
reach a target loss, and plots the noise scale over training. See README.md.

Run it from the repository root::

  python examples/noise_scale/main.py     # about 30 s on 2 CPU cores
  python examples/noise_scale/main.py --k 16 --out /tmp/noise_scale.png
"""

import argparse
from collections.abc import Sequence
from typing import Any

import report
import train


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=60,
                      help="optimizer updates of the fixed-k run; the"
                      " adaptive run gets the same steps * k micro-batches")
  parser.add_argument("--k", type=int, default=8,
                      help="micro-batches per update of the fixed run (and"
                      " of the adaptive run's first update)")
  parser.add_argument("--max-k", type=int, default=64,
                      help="most micro-batches per update of the adaptive run")
  parser.add_argument("--microbatch-size", type=int, default=4,
                      help="verses per micro-batch")
  parser.add_argument("--ema", type=float, default=0.9,
                      help="decay per update of the moving averages of |G|^2"
                      " and tr(Sigma) whose ratio is the smoothed noise scale")
  parser.add_argument("--target-loss", type=float, default=2.4,
                      help="loss whose first crossing the table reports")
  parser.add_argument("--loss-window", type=int, default=4000,
                      help="training tokens over which the reported loss is"
                      " averaged")
  parser.add_argument("--seq-len", type=int, default=128,
                      help="bytes per padded sequence")
  parser.add_argument("--dim", type=int, default=48, help="model width")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="learning rate after the warm-up (AdamW)")
  parser.add_argument("--warmup", type=int, default=5,
                      help="updates of linear learning-rate warm-up")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialisation, prompts and order")
  parser.add_argument("--out", default="noise_scale.png",
                      help="where to save the plot ('' for no plot)")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress bar, table or messages")
  args = parser.parse_args(argv)
  if args.k < 2 or args.max_k < args.k:
    parser.error(f"need 2 <= --k {args.k} <= --max-k {args.max_k}: the"
                 " estimate needs two micro-batches per update.")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs both trainings; returns their per-update histories."""
  args = parse_args(argv)
  results = train.train_and_compare(args)
  if not args.quiet:
    report.print_summary(results)
  if args.out:
    results["plot"] = report.plot(results, args.out)
    if not args.quiet:
      print(f"Plot saved to {results['plot']}")
  return results


if __name__ == "__main__":
  main()
