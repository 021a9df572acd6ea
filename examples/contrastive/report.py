"""The summary table and the plot of the three runs."""

import pathlib
from typing import Any

import numpy as np

from train import LABELS
from train import RUNS


def print_summary(results: dict[str, Any]) -> None:
  """Prints each run's final loss, retrieval accuracy and gap to (a)."""
  print(f"\n{results['steps']} steps of {results['batch_size']} pairs,"
        f" k={results['k']} micro-batches of"
        f" {results['batch_size'] // results['k']}"
        f" ({results['seconds']:.0f} s)\n")
  header = (f"{'run':<38} {'InfoNCE':>8} {'held-out top-1':>15}"
            f" {'max |param - (a)|':>18}")
  print(header)
  print("-" * len(header))
  for run in RUNS:
    diff = results["max_param_diff"].get(run, 0.0)
    print(f"{LABELS[run]:<38} {results['final_loss'][run]:>8.4f}"
          f" {results['final_accuracy'][run]:>15.3f} {diff:>18.2e}")
  print(f"(InfoNCE: the whole batch's, mean of the last 10 steps; top-1: the"
        f" share of {results['held_out']} held-out images whose second view"
        " is the nearest to their first)")


def plot(results: dict[str, Any], out: str) -> str:
  """Saves the loss curves, the retrieval accuracy and the gaps to (a)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  steps = np.arange(1, results["steps"] + 1)
  styles = {
      "full_batch": dict(color="black", lw=3.5, alpha=0.3),
      "coupled": dict(color="tab:blue", lw=1.2, ls="--"),
      "naive": dict(color="tab:red", lw=1.0),
  }
  fig, (top, middle, bottom) = plt.subplots(
      3, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 2, 2))
  for run in RUNS:
    top.plot(steps, results["losses"][run], label=LABELS[run], **styles[run])
  top.set_ylabel("InfoNCE of the whole batch")
  top.set_title(f"Two views of 8x8 digits, batch {results['batch_size']},"
                f" k={results['k']} micro-batches")
  top.legend(loc="upper right")
  top.grid(alpha=0.3)

  for run in RUNS:
    middle.plot(results["eval_steps"], results["accuracies"][run],
                marker="o", ms=3, label=LABELS[run], **styles[run])
  middle.set_ylabel(f"held-out top-1 retrieval\n({results['held_out']}"
                    " candidates)")
  middle.legend(loc="lower right")
  middle.grid(alpha=0.3)

  for run in ("coupled", "naive"):
    gap = np.maximum(results["param_diffs"][run], 1e-12)
    bottom.semilogy(steps, gap, color=styles[run]["color"], label=LABELS[run])
  bottom.set_ylabel("max |param - (a)|")
  bottom.set_xlabel("optimizer step")
  bottom.legend(loc="center right")
  bottom.grid(alpha=0.3, which="both")
  fig.tight_layout()
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)
