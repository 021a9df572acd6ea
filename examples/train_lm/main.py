r"""Train a small byte-level transformer three ways: exact accumulation wins.

This is the example to run first. It fine-tunes a small Flax NNX decoder-only
transformer to complete verses of the King James Bible, three times, from the
same initialisation and on the same batches: (a) on the full batch, (b) on
``k`` micro-batches with ``oa.accumulate`` and ``num_tokens=``, (c) on the same
micro-batches with ``optax.MultiSteps`` (a mean of per-micro-batch means). The
micro-batches hold very uneven numbers of tokens, so (b) follows (a) to float32
rounding and (c) optimizes another objective. See README.md.

Run it from the repository root::

  python examples/train_lm/main.py     # about a minute on 2 idle CPU cores
  python examples/train_lm/main.py --k 4 --steps 300 --out /tmp/lm.png
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
  parser.add_argument("--steps", type=int, default=150,
                      help="optimizer steps (full batches) per run")
  parser.add_argument("--k", type=int, default=8,
                      help="micro-batches per batch for runs (b) and (c)")
  parser.add_argument("--batch-size", type=int, default=32,
                      help="sequences (verses) per full batch")
  parser.add_argument("--seq-len", type=int, default=128,
                      help="bytes per padded sequence")
  parser.add_argument("--dim", type=int, default=48, help="model width")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="peak learning rate (warm-up, then cosine decay)")
  parser.add_argument("--group-by-length",
                      action=argparse.BooleanOptionalAction, default=True,
                      help="sort each batch by token count before splitting"
                      " it, which makes the micro-batches' token counts"
                      " uneven")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialisation, prompts and batches")
  parser.add_argument("--out", default="train_lm.png",
                      help="where to save the plot ('' for no plot)")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress bar, table or messages")
  args = parser.parse_args(argv)
  if args.batch_size % args.k:
    parser.error(f"--batch-size {args.batch_size} must be divisible by"
                 f" --k {args.k}.")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the three trainings; returns their losses and parameter gaps."""
  args = parse_args(argv)
  results = train.train_and_evaluate(args)
  if not args.quiet:
    report.print_summary(results)
  if args.out:
    results["plot"] = report.plot(results, args.batch_size, args.out)
    if not args.quiet:
      print(f"Plot saved to {results['plot']}")
  return results


if __name__ == "__main__":
  main()
