"""The summary table and the plot of the two runs."""

import pathlib
from typing import Any

import numpy as np

from train import RUNS

LABELS = {"fixed": "fixed k", "adaptive": "adaptive (cycle = noise scale)"}
COLORS = {"fixed": "tab:blue", "adaptive": "tab:orange"}


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def print_summary(results: dict[str, Any]) -> None:
  """Prints updates and tokens to the target loss, and the final losses."""
  args = results["args"]
  print(f"\nSame {args['steps'] * args['k']} micro-batches of"
        f" {args['microbatch_size']} verses for both runs; fixed k={args['k']};"
        f" target loss {args['target_loss']} ({results['seconds']:.0f} s)\n")
  header = (f"{'run':<31} {'updates':>7} {'to target: updates':>18}"
            f" {'tokens':>8} {'final loss':>10} {'held-out':>8}"
            f" {'noise scale':>12} {'|G|^2 < 0':>9}")
  print(header)
  print("-" * len(header))
  for run in RUNS:
    h = results[run]
    scale = h["smoothed_noise_scale"]
    finite = scale[np.isfinite(scale)]
    scales = (f"{finite[0]:.0f} -> {finite[-1]:.0f}" if len(finite) else "-")
    print(f"{LABELS[run]:<31} {h['updates']:>7}"
          f" {_fmt(h['updates_to_target'], 'd'):>18}"
          f" {_fmt(h['tokens_to_target'], '.0f'):>8}"
          f" {h['smoothed_loss'][-1]:>10.4f} {h['held_out_loss']:>8.4f}"
          f" {scales:>12} {np.sum(h['grad_sq_norm'] < 0):>9}")
  print(f"(loss: per completion token, over the last {args['loss_window']}"
        " training tokens, each seen once before its update; noise scale:"
        " smoothed, in tokens, first -> last; |G|^2 < 0: updates whose own"
        " estimate of |G|^2 was negative)")


def plot(results: dict[str, Any], out: str) -> str:
  """Saves loss, noise scale and cycle size against tokens, and B vs loss."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  args = results["args"]
  fig, axes = plt.subplots(2, 2, figsize=(11, 8))
  (loss_ax, scale_ax), (cycle_ax, vs_loss_ax) = axes
  for run in RUNS:
    h, color = results[run], COLORS[run]
    loss_ax.plot(h["tokens"], h["smoothed_loss"], color=color,
                 label=f"{LABELS[run]} ({h['updates']} updates)")
    raw = np.where(h["noise_scale"] > 0, h["noise_scale"], np.nan)
    scale_ax.scatter(h["tokens"], raw, color=color, s=6, alpha=0.25)
    scale_ax.plot(h["tokens"], h["smoothed_noise_scale"], color=color,
                  label=f"{LABELS[run]}: EMA")
    cycle_ax.step(h["tokens"], h["cycle_tokens"], where="post", color=color,
                  label=LABELS[run])
    vs_loss_ax.plot(h["smoothed_loss"], h["smoothed_noise_scale"], color=color,
                    label=LABELS[run])
  loss_ax.axhline(args["target_loss"], color="gray", ls=":", lw=1,
                  label=f"target {args['target_loss']}")
  loss_ax.set_ylabel("training loss (per token, trailing window)")
  loss_ax.set_title("Loss against tokens seen")
  scale_ax.set_yscale("log")
  scale_ax.set_ylabel("noise scale B = tr(Sigma) / |G|^2 (tokens)")
  scale_ax.set_title("Noise scale: each update (dots), smoothed (lines)")
  cycle_ax.set_ylabel("tokens per update")
  cycle_ax.set_title("Batch size: the adaptive run follows the noise scale")
  vs_loss_ax.set_xlabel("training loss")
  vs_loss_ax.set_ylabel("smoothed noise scale (tokens)")
  vs_loss_ax.set_yscale("log")
  vs_loss_ax.invert_xaxis()
  vs_loss_ax.set_title("Noise scale as the loss falls (left to right)")
  for ax in (loss_ax, scale_ax, cycle_ax):
    ax.set_xlabel("training tokens seen")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("Gradient noise scale of a byte-level transformer on KJV"
               f" verses, micro-batches of {args['microbatch_size']} verses")
  fig.tight_layout()
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return str(path)
