"""e. Accumulator memory: the state's bytes and the compiled train step's.

The train steps of benchmark a (compiled, never run): what ``oa.accumulate``
and ``optax.MultiSteps`` keep beyond the inner optimizer's state, and what
XLA's memory analysis and HLO say the compiled step allocates and copies.
Checked: our state holds one parameter-sized float32 buffer (plus scalars)
beyond the inner state.
"""

import bench_cycle
import harness
import hlo_report
import report
import train_steps

KEY = "e"
TITLE = "Accumulator memory (train step, k micro-steps)"
# The sizes of benchmark a (the toy size leaves muon to a: it compiles slowly).
CONFIGS = {
    "full": {"k": 8, "inners": {"adamw": {"leaves": 10, "size": 1024},
                                "muon": {"leaves": 10, "size": 1024}}},
    "quick": {"k": 8, "inners": {"adamw": {"leaves": 10, "size": 512},
                                 "muon": {"leaves": 10, "size": 256}}},
    "toy": {"k": 2, "inners": {"adamw": {"leaves": 2, "size": 32}}},
}
OURS, PEER = "oa.accumulate", "optax.MultiSteps"
SCALAR_BYTES = 1024  # Counters and token counts: a few scalars, not a buffer.


def measure(inner, k, leaves, size):
  """Bytes of each candidate's state and of its compiled train step."""
  params, grads = train_steps.param_tree(leaves, size)
  inner_bytes = harness.tree_bytes(inner.init(params))
  entry = {"leaves": leaves, "shape": [size, size], "k": k,
           "param_bytes": harness.tree_bytes(params), "candidates": {}}
  for name, tx in bench_cycle.transformations(inner, k).items():
    t = train_steps.Trainer(tx, params, grads)
    entry["candidates"][name] = {
        "state_bytes": t.state_bytes,
        "inner_state_bytes": inner_bytes,
        "accumulator_overhead_bytes": t.state_bytes - inner_bytes,
        "compiled": harness.memory(t.compiled),
        "hlo": {key: val for key, val in hlo_report.hlo_stats(
            t.compiled.as_text()).items() if key != "per_computation"},
    }
  return entry


def run(cfg):
  return {name: measure(bench_cycle.inner_optimizer(name), cfg["k"], **sizes)
          for name, sizes in cfg["inners"].items()}


def checks(result):
  return [harness.Check(
      f"{inner} {OURS}: state beyond the inner state minus one parameter "
      "copy (bytes, absolute)",
      abs(e["candidates"][OURS]["accumulator_overhead_bytes"]
          - e["param_bytes"]),
      SCALAR_BYTES) for inner, e in result.items()]


def summary_rows(result):
  e = result.get("adamw")
  if not e:
    return []
  ours, peer = e["candidates"][OURS], e["candidates"][PEER]
  pb = e["param_bytes"]

  def overhead(c):
    b = c["accumulator_overhead_bytes"]
    return f"{report.mib(b)} ({b / pb:.3f} x params)"

  ours_peak, peer_peak = (c["compiled"]["peak_bytes"] for c in (ours, peer))
  return [
      report.Row("e. adamw state beyond the inner state (accumulator)",
                 overhead(ours), overhead(peer), "-",
                 "one param-sized f32 buffer",
                 abs(ours["accumulator_overhead_bytes"] - pb) < SCALAR_BYTES),
      report.Row("e. adamw train step: compiled peak memory",
                 harness.peak_label(ours["compiled"], report.mib),
                 harness.peak_label(peer["compiled"], report.mib),
                 f"{ours_peak / max(1, peer_peak):.2f}x",
                 "less than MultiSteps", ours_peak < peer_peak),
  ]


def markdown(result):
  lines = ["| inner | candidate | state | inner state | beyond inner | "
           "compiled peak | args | out | alias | temp | HLO copies (MiB) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for inner, e in result.items():
    for name, c in e["candidates"].items():
      cm, mib = c["compiled"], report.mib
      lines.append(
          f"| {inner} | {name} | {mib(c['state_bytes'])} | "
          f"{mib(c['inner_state_bytes'])} | "
          f"{mib(c['accumulator_overhead_bytes'])} | "
          f"{harness.peak_label(cm, mib)} | {mib(cm['argument_bytes'])} | "
          f"{mib(cm['output_bytes'])} | "
          f"{mib(cm['alias_bytes'])} | {mib(cm['temp_bytes'])} | "
          f"{c['hlo']['copy']} ({c['hlo']['copy_bytes'] / harness.MiB:.0f}) |")
  return lines + ["", harness.MEMORY_REF]
