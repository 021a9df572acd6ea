"""The summary table and the plot of the three runs."""

import pathlib
from typing import Any

import numpy as np

from train import LABELS
from train import RUNS


def print_summary(results: dict[str, Any]) -> None:
  """Prints each run's final losses and its largest parameter gap to (a)."""
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


def plot(results: dict[str, Any], batch_size: int, out: str) -> str:
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
  _zoom_past_the_first_steps(top, steps, losses)
  top.set_ylabel("loss of the full batch\n(per completion token)")
  top.set_title(
      f"Byte-level transformer, batch {batch_size} verses,"
      f" k={results['k']} micro-batches of uneven token counts")
  top.legend(loc="upper right")
  top.grid(alpha=0.3)

  # (b)'s gap is zero to rounding: it lies on the zero line, so the line is
  # thin, dashed and drawn beneath, and (b) on top of everything.
  middle.axhline(0.0, color="gray", lw=0.6, ls=":", zorder=1)
  for run in ("accumulate", "naive"):
    gap = losses[run] - losses["full_batch"]
    on_top = run == "accumulate"
    middle.plot(steps, gap, color=styles[run]["color"],
                lw=1.6 if on_top else 1.0, alpha=1.0 if on_top else 0.5,
                zorder=4 if on_top else 2, label=LABELS[run])
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
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)


def _zoom_past_the_first_steps(axes, steps, losses) -> None:
  """Zooms in on the late steps, where the runs differ, and says what is cut.

  All runs fall from the same high loss in the first steps; showing them would
  squash the gap between (c) and the others into a line.
  """
  late = losses["full_batch"][len(steps) // 5 :]
  spread = late.max() - late.min()
  top = late.max() + 0.5 * spread
  axes.set_ylim(min(h.min() for h in losses.values()) - 0.1 * spread, top)
  above = np.flatnonzero(np.max([losses[run] for run in RUNS], axis=0) > top)
  if len(above):
    axes.annotate(
        f"y-axis zoomed in:\nuntil step {steps[above[-1]]} the\nloss is off"
        f" the top\n(all runs start\nat {losses['full_batch'][0]:.2f})",
        xy=(steps[above[-1]], top), xytext=(0.015, 0.45),
        textcoords="axes fraction", va="top", fontsize="small",
        arrowprops=dict(arrowstyle="->", color="gray"),
        bbox=dict(boxstyle="round", fc="white", ec="gray", alpha=0.9))
