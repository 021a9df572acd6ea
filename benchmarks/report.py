"""The report of a run: a Markdown file, a JSON file and a PNG plot.

The Markdown opens with the headline table (every benchmark's
``summary_rows``: ours, the peer, the ratio, the target and whether it holds),
then has a section per benchmark (its ``markdown``). The JSON holds every
figure measured. The PNGs are drawn by the benchmarks that define ``plot``.
"""

import json
import os
from typing import NamedTuple

from harness import MEMORY_NOTE
from harness import MiB


class Row(NamedTuple):
  """One line of the headline table, formatted, and whether its target holds."""
  what: str
  ours: str
  peer: str
  ratio: str
  target: str
  holds: bool


def ms(seconds):
  return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def mib(nbytes):
  return f"{nbytes / MiB:.1f} MiB"


def spec(model_spec):
  return json.dumps(model_spec)


def _load(avg):
  return "/".join(f"{x:.1f}" for x in avg) if avg else "?"


def _holds(ok):
  return "yes" if ok else "**no**"


def header(res):
  m = res["machine"]
  return [
      f"# optax_accum benchmarks ({res['size']} run)",
      "",
      f"{m['date']} | {m['cpu']}, {m['cores']} cores, "
      f"{(m['memory_bytes'] or 0) / 2**30:.0f} GiB | backend {m['backend']} | "
      f"jax {m['jax']}, optax {m['optax']}, flax {m['flax']}, "
      f"optax_accum {m['optax_accum']} | python {m['python']}",
      "",
      "Medians of interleaved repetitions (wall clock); ratios are of medians."
      f" Load average (1/5/15 min) at start {_load(m['loadavg_start'])},"
      f" at end {_load(m.get('loadavg_end'))} (this benchmark alone keeps it"
      f" near {m['cores']}; more means other processes shared the cores).",
      "",
      MEMORY_NOTE,
  ]


def failed_checks(res):
  """The correctness checks (as recorded in ``res``) that do not hold."""
  return [c for checks in res["checks"].values() for c in checks
          if not c["holds"]]


def markdown(res, benchmarks):
  """The whole Markdown report of ``res`` from the benchmarks that ran."""
  lines = header(res) + ["", "| benchmark | ours | peer | ratio | target | "
                         "holds |", "|---|---|---|---|---|---|"]
  for row in res["summary"]:
    row = Row(*row)
    lines.append("| " + " | ".join(row[:-1] + (_holds(row.holds),)) + " |")
  failed = failed_checks(res)
  if failed:
    lines += ["", "**Correctness checks that failed:**", ""]
    lines += [f"- {c['what']}: {c['value']:.3g} > {c['limit']:.3g}"
              for c in failed]
  lines.append("")
  for bench in benchmarks:
    lines += [f"## {bench.KEY}. {bench.TITLE}", ""]
    lines += bench.markdown(res[bench.KEY]) + [""]
  return "\n".join(lines)


def plot_paths(prefix, benchmarks):
  """Each plot's file: ``PREFIX{PLOT_SUFFIX}.png``, ``PREFIX.KEY.png`` if none.

  Benchmark d's suffix is empty: its plot is ``latest.png``, the README's.
  """
  return {b.KEY: prefix + getattr(b, "PLOT_SUFFIX", f".{b.KEY}") + ".png"
          for b in benchmarks if hasattr(b, "plot")}


def save_plot(bench, res, path):
  from matplotlib.figure import Figure  # Only a plot needs matplotlib.
  fig = Figure()
  bench.plot(res[bench.KEY], fig)
  m = res["machine"]
  fig.suptitle(f"optax_accum, {m['cpu']}, {m['cores']} cores, jax {m['jax']}",
               fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def write(res, benchmarks, prefix):
  """Writes ``PREFIX.md``, ``PREFIX.json`` and the plots; returns the paths."""
  text = markdown(res, benchmarks)
  os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
  with open(prefix + ".md", "w") as f:
    f.write(text + "\n")
  with open(prefix + ".json", "w") as f:
    json.dump(res, f, indent=1, default=str)
  paths = [prefix + ".md", prefix + ".json"]
  plots = plot_paths(prefix, benchmarks)
  for bench in benchmarks:
    if bench.KEY in plots:
      save_plot(bench, res, plots[bench.KEY])
      paths.append(plots[bench.KEY])
  return text, paths
