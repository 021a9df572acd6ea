r"""Train a contrastive encoder three ways: coupled accumulation is exact.

An MLP learns to embed two augmented views of the same 8x8 digit close
together and apart from the other images of the batch (symmetric InfoNCE with
in-batch negatives and a learned temperature). It is trained three times from
the same start on the same batches: (a) on the full batch, (b) with
``oa.coupled_value_and_grad`` over ``k`` micro-batches, which follows (a) to
float32 rounding, and (c) with naive accumulation, where each micro-batch sees
only its own negatives: another objective, and worse held-out retrieval. See
README.md.

Run it from the repository root::

  python examples/contrastive/main.py        # about a minute on 2 CPU cores
  python examples/contrastive/main.py --k 16 --steps 600 --out /tmp/c.png
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
  parser.add_argument("--steps", type=int, default=300,
                      help="optimizer steps (full batches) per run")
  parser.add_argument("--batch-size", type=int, default=512,
                      help="pairs of views per batch: each row's negatives"
                      " are the other rows")
  parser.add_argument("--k", type=int, default=16,
                      help="micro-batches per batch for runs (b) and (c)")
  parser.add_argument("--hidden", type=int, default=256,
                      help="width of the encoder's hidden layers")
  parser.add_argument("--layers", type=int, default=2,
                      help="hidden layers of the encoder")
  parser.add_argument("--dim", type=int, default=32,
                      help="embedding dimension")
  parser.add_argument("--lr", type=float, default=2e-3,
                      help="peak learning rate of Adam (cosine decay)")
  parser.add_argument("--held-out", type=int, default=400,
                      help="images set aside for the retrieval metric")
  parser.add_argument("--eval-every", type=int, default=25,
                      help="steps between two retrieval evaluations")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialisation and the batches")
  parser.add_argument("--out", default="contrastive.png",
                      help="where to save the plot ('' for no plot)")
  parser.add_argument("--quiet", action="store_true",
                      help="no progress bar, table or messages")
  args = parser.parse_args(argv)
  if args.batch_size % args.k:
    parser.error(f"--batch-size {args.batch_size} must be divisible by"
                 f" --k {args.k}.")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the three trainings; returns their losses, accuracies and gaps."""
  args = parse_args(argv)
  results = train.train_and_evaluate(args)
  if not args.quiet:
    report.print_summary(results)
  if args.out:
    results["plot"] = report.plot(results, args.out)
    if not args.quiet:
      print(f"Plot saved to {results['plot']}")
  return results


if __name__ == "__main__":
  main()
