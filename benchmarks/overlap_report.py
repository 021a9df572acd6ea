"""Benchmark q's report: checks, summary rows and the Markdown table.

They read :func:`overlap_measure.summary`'s figures.
"""

import bench_compiled
import harness
import overlap_candidates as oc
import report

# The targets: share >= 80% where the compiler overlaps; peak within 1% of
# today's and of the scan's; compile time within 1.5x of today's.
SHARE_TARGET, PEAK_TARGET, COMPILE_TARGET = 0.8, 1.01, 1.5


def _median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2] if xs else None


def _ratio(c, cand, peer, what):
  ours, theirs = c.get(cand, {}).get(what), c.get(peer, {}).get(what)
  return None if ours is None or not theirs else ours / theirs


def _compile_ratio(c, cand, peer):
  if not (c.get(cand, {}).get("compile_s") and c.get(peer, {}).get(
      "compile_s")):
    return None
  return _median(c[cand]["compile_s"]) / _median(c[peer]["compile_s"])


def checks(result):
  out = []
  for setting, r in result["compilers"].items():
    for name, m in r["meshes"].items():
      c = m["candidates"]
      if "overlap" in c.get(oc.OURS, {}) and "overlap" in c.get(
          oc.TODAY, {}):
        out.append(harness.Check(
            f"q. {setting}, {name}: ours's gradient bytes per update /"
            " today's", c[oc.OURS]["per_update_bytes"]
            / max(c[oc.TODAY]["per_update_bytes"], 1), 1.0))
  return out or [harness.Check("q. nothing compiled", 0, 0)]


def summary_rows(result):
  rows = []
  for setting, r in result["compilers"].items():
    for name, m in r["meshes"].items():
      c = m["candidates"]
      if "overlap" not in c.get(oc.OURS, {}):
        continue
      share = c[oc.OURS]["overlap"]["share"]
      if oc.overlaps_here(setting):
        rows.append(report.Row(
            f"q. {setting}, {name}: reduction bytes overlapped, ours",
            f"{share:.1%}", f"{c[oc.SCAN]['overlap']['share']:.1%}"
            if "overlap" in c.get(oc.SCAN, {}) else "-", "-",
            f">= {SHARE_TARGET:.0%}",
            share >= SHARE_TARGET))
      for peer in (oc.TODAY, oc.SCAN):
        ratio = _ratio(c, oc.OURS, peer, "peak_bytes")
        if ratio is not None:
          rows.append(report.Row(
              f"q. {setting}, {name}: peak per device, ours / {peer}",
              report.mib(c[oc.OURS]["peak_bytes"]),
              report.mib(c[peer]["peak_bytes"]), f"{ratio:.3f}x",
              f"<= {PEAK_TARGET}x", ratio <= PEAK_TARGET))
      ratio = _compile_ratio(c, oc.OURS, oc.TODAY)
      if ratio is not None:
        rows.append(report.Row(
            f"q. {setting}, {name}: compile time, ours / today",
            f"{_median(c[oc.OURS]['compile_s']):.1f} s",
            f"{_median(c[oc.TODAY]['compile_s']):.1f} s", f"{ratio:.2f}x",
            f"<= {COMPILE_TARGET}x", ratio <= COMPILE_TARGET))
  return rows or [report.Row("q. compile-only devices", "skipped", "-", "-",
                             "-", True)]


def _counts(x):
  col = x["collectives"]
  parts = [f"{where.replace('_', ' ')} {n} {name}"
           for where in ("in_loop", "outside", "in_branch")
           for name, n in sorted(col[where].items())]
  return ", ".join(parts) or "-"


def _sums(x):
  s = x["loop_sums"]
  if not s["counts"]:
    return "no loop sums"
  counts = ", ".join(f"{n} {kind}" for kind, n in sorted(s["counts"].items()))
  return f"{counts}; {s['bytes_per_parameter']:.1f} B/param"


def table(result):
  lines = [
      "| compiler | mesh | candidate | share overlapped | reductions"
      " (async, before last matmul) | GFLOP between | peak / device |"
      " vs today | vs scan | compile s | vs today | lower s | data-axis"
      " reductions (count_collectives) | bytes per update | loop sums |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for setting, r in result["compilers"].items():
    for name, m in r["meshes"].items():
      c = m["candidates"]
      for cand in oc.CANDIDATES:
        if "refused" in c.get(cand, {}):
          lines.append(f"| {setting} | {name} | {cand} | refused:"
                       f" {c[cand]['refused']} |" + " |" * 11)
        if "overlap" not in c.get(cand, {}):
          continue
        x, o = c[cand], c[cand]["overlap"]
        n_async, n_before = o["asynchronous"], o["before_last_matmul"]
        ratios = [_ratio(c, cand, p, "peak_bytes")
                  for p in (oc.TODAY, oc.SCAN)]
        lines.append(
            f"| {setting} | {name} | {cand} | {o['share']:.1%} |"
            f" {o['reductions']} ({n_async}, {n_before}) |"
            f" {o['flops_between'] / 1e9:.1f} |"
            f" {report.mib(x['peak_bytes'])} |"
            + "".join(f" {'-' if q is None else f'{q:.3f}x'} |"
                      for q in ratios)
            + f" {_median(x['compile_s']):.1f} |"
            f" {bench_compiled._times(_compile_ratio(c, cand, oc.TODAY))} |"
            f" {_median(x['lower_s']):.1f} | {_counts(x)} |"
            f" {report.mib(x['per_update_bytes'])} | {_sums(x)} |")
  return lines + [""]


def markdown(result):
  lines = [
      "Compiled on this machine for 8 compile-only devices (TPU v5e `2x4`;"
      " 8 H100 SXM), nothing run; the decoder of `zoo/typed_model.py`"
      f" `{report.spec(result['model'])}`, a batch of {result['batch']}"
      f" sequences, k={result['k']}. share: `oa.reduction_overlap`'s"
      " overlapped share of the data-axis gradient reduction's bytes;"
      " compile s: `lowered.compile()` wall time, median of the repetitions,"
      " the candidates interleaved in one process; loop sums: what produces"
      " each float32 running sum in the micro-batch loop's body.", ""]
  for setting, why in result["skipped"].items():
    lines += [f"Skipped {setting}: {why}", ""]
  return lines + table(result)
