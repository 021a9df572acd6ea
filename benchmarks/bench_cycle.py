"""a. One accumulation cycle: ``oa.accumulate`` vs ``optax.MultiSteps``.

k micro-steps of a jitted, donated train step (``tx.update`` and
``optax.apply_updates``), with adamw and with muon as the inner optimizer.
Checked: the parameters after the same cycles agree with MultiSteps'.
"""

import optax

import harness
import optax_accum as oa
import report
import train_steps

KEY = "a"
TITLE = "One accumulation cycle (k micro-steps, donated train step)"
CONFIGS = {
    "full": {"k": 8, "inners": {
        "adamw": {"leaves": 10, "size": 1024, "reps": 15},
        "muon": {"leaves": 10, "size": 1024, "reps": 3}}},
    "quick": {"k": 8, "inners": {
        "adamw": {"leaves": 10, "size": 512, "reps": 7},
        "muon": {"leaves": 10, "size": 256, "reps": 3}}},
    "toy": {"k": 2, "inners": {
        "adamw": {"leaves": 2, "size": 32, "reps": 1},
        "muon": {"leaves": 2, "size": 32, "reps": 1}}},
}
# Speedup over MultiSteps: (the least that holds, the aim or None).
TARGETS = {"adamw": (3.0, None), "muon": (5.0, None)}  # issue 38: 3x.
OURS, PEER = "oa.accumulate", "optax.MultiSteps"
FUSED = "oa.accumulate, oa.update_and_apply"


def inner_optimizer(name):
  """The inner optimizers: ``adamw`` or ``muon``."""
  if name == "adamw":
    return optax.adamw(1e-3, weight_decay=1e-4)
  if name == "muon":
    return optax.contrib.muon(1e-3)
  raise ValueError(f"inner optimizer {name!r} is neither 'adamw' nor 'muon'.")


def transformations(inner, k):
  # MultiSteps takes the plain mean of its micro-batches: equal weights.
  return {OURS: oa.accumulate(inner, k, equal_weights=True),
          PEER: optax.MultiSteps(inner, k)}


def time_cycles(inner, k, leaves, size, reps):
  """Times k micro-steps of each candidate; checks the parameters agree."""
  params, grads = train_steps.param_tree(leaves, size)
  txs = transformations(inner, k)
  trainers = {name: train_steps.Trainer(tx, params, grads)
              for name, tx in txs.items()}
  # The same accumulate, applied in its emitting branch (issue 38, item 5).
  trainers[FUSED] = train_steps.Trainer(txs[OURS], params, grads,
                                        train_steps.IN_BRANCH)
  # Warm-up: one micro-step each. Any k consecutive micro-steps hold exactly
  # one emitting step, so the timed cycles need not start a cycle.
  for t in trainers.values():
    t.steps(1)
  times = harness.interleaved(
      {n: (lambda t=t: t.steps(k)) for n, t in trainers.items()},
      reps=reps, warmup=0)
  # Same gradients, same number of cycles: the parameters must agree.
  ref = trainers[PEER].params
  summaries = harness.summarize_times(times)
  return {
      "leaves": leaves, "shape": [size, size], "k": k,
      "param_bytes": harness.tree_bytes(params),
      "max_abs_param": harness.max_abs(ref),
      "candidates": {name: {
          "cycle": summaries[name],
          "max_abs_param_diff_vs_multisteps": harness.max_abs_diff(
              t.params, ref)} for name, t in trainers.items()},
  }


def run(cfg):
  return {name: time_cycles(inner_optimizer(name), cfg["k"], **sizes)
          for name, sizes in cfg["inners"].items()}


def checks(result):
  return [harness.Check(
      f"{inner} {name}: max abs param diff vs MultiSteps / max abs param",
      c["max_abs_param_diff_vs_multisteps"] / e["max_abs_param"], 1e-5)
          for inner, e in result.items()
          for name, c in e["candidates"].items()]


def summary_rows(result):
  rows = []
  for inner, e in result.items():
    target, aim = TARGETS[inner]
    ours = e["candidates"][OURS]["cycle"]["median_s"]
    peer = e["candidates"][PEER]["cycle"]["median_s"]
    shape = "x".join(map(str, e["shape"]))
    goal = f">= {target}x" + (f" (aim {aim}x)" if aim else "")
    rows.append(report.Row(
        f"a. cycle of k={e['k']}, {inner}, {e['leaves']} x {shape} f32: "
        "speedup vs optax.MultiSteps", report.ms(ours), report.ms(peer),
        f"{peer / ours:.2f}x", goal, peer / ours >= target))
    fused = e["candidates"].get(FUSED, {}).get("cycle", {}).get("median_s")
    if fused:
      rows.append(report.Row(
          f"a. cycle of k={e['k']}, {inner}, {e['leaves']} x {shape} f32:"
          " speedup vs optax.MultiSteps, applied with oa.update_and_apply",
          report.ms(fused), report.ms(peer), f"{peer / fused:.2f}x",
          ">= 3.0x" if inner == "adamw" else "-",
          inner != "adamw" or peer / fused >= 3.0))
  return rows


def markdown(result):
  lines = ["| inner | candidate | cycle median | p25-p75 | CPU median | "
           "reps | max abs param diff vs MultiSteps |",
           "|---|---|---|---|---|---|---|"]
  for inner, e in result.items():
    for name, c in e["candidates"].items():
      t = c["cycle"]
      lines.append(f"| {inner} | {name} | {report.ms(t['median_s'])} | "
                   f"{report.ms(t['p25_s'])} - {report.ms(t['p75_s'])} | "
                   f"{report.ms(t['cpu_median_s'])} | {t['reps']} | "
                   f"{c['max_abs_param_diff_vs_multisteps']:.2e} |")
  return lines

