"""b. One non-emitting micro-step of ``oa.accumulate`` vs the floor.

The floor is a jitted, donated ``tree_map(add)`` of the gradient into an
accumulator. Checked: a non-emitting micro-step changes no parameter and
returns zero updates, and the train steps accumulate what the floor does.

It runs twice, each time in a child process: with glibc's malloc as it comes,
and with glibc told to keep freed memory (``GLIBC_TUNABLES``, see
``ALLOCATORS``). XLA's CPU runtime takes a program's temporaries from malloc
on every call; glibc maps an allocation over 32 MiB fresh from the kernel and
unmaps it when freed, so each call page-faults once per 4 KiB of it. The
updates ``tx.update`` hands back need no temporary of their own (they are
kept in the running sum's buffer), so a train step given its gradients
page-faults no more than the floor (before: 10^4 faults per call, 5.5x the
floor). A GPU's allocator (XLA's BFC) keeps its memory, as the second
setting does.
"""

import json
import sys

import optax

import harness
import hlo_report
import optax_accum as oa
import report
import train_steps

KEY = "b"
TITLE = "Non-emitting micro-step"
CONFIGS = {
    "full": {"leaves": 10, "size": 1024, "reps": 40, "calls_per_rep": 4},
    "quick": {"leaves": 10, "size": 512, "reps": 15, "calls_per_rep": 4},
    "toy": {"leaves": 2, "size": 32, "reps": 1, "calls_per_rep": 2},
}
TARGET = 1.5  # At most this many times the floor's median.
FLOOR = "floor tree_map(add)"
APPLY_IF_UPDATED = "oa.accumulate train step, oa.apply_if_updated"
# The same, in train steps that compute their gradient (a dot per leaf).
GRAD_FLOOR = "grad in step: floor grad + tree_map(add)"
GRAD_APPLY_IF_UPDATED = "grad in step: oa.accumulate + oa.apply_if_updated"
GRAD_APPLY_UPDATES = "grad in step: oa.accumulate + optax.apply_updates"
DESCRIPTION = (
    "`update only`: jitted `tx.update` with the state and the gradients "
    "donated (the zero updates, `where(updated, sum, 0)`, written into the "
    "gradients' buffer; reads 3N, writes 2N bytes); `train step`: "
    "`tx.update` + `optax.apply_updates`, params and state donated (the "
    "select fused into a read-2N write-N pass over the params); `train "
    "step, oa.apply_if_updated`: the add in the emitting branch of a "
    "`lax.cond`, reading the updates kept in the sum's buffer (the params "
    "pass through; no zero updates are written); floor: jitted "
    "`tree_map(add)` with the accumulator donated (reads 2N, writes N bytes). "
    "`grad in step`: train steps that compute their gradient (a 4-row dot "
    "per leaf) as real ones do, the floor the same gradient.")


def runners(params, grads, x):
  inner = optax.adamw(1e-3, weight_decay=1e-4)
  tx = oa.accumulate(inner, train_steps.NEVER, equal_weights=True)
  return {
      FLOOR: train_steps.Floor(params, grads),
      "oa.accumulate update only": train_steps.UpdateOnly(tx, params, grads),
      "oa.accumulate train step": train_steps.Trainer(tx, params, grads),
      APPLY_IF_UPDATED: train_steps.Trainer(tx, params, grads,
                                            oa.apply_if_updated),
      "optax.MultiSteps train step": train_steps.Trainer(
          optax.MultiSteps(inner, train_steps.NEVER), params, grads),
      GRAD_FLOOR: train_steps.GradFloor(params, x),
      GRAD_APPLY_IF_UPDATED: train_steps.GradTrainer(tx, params, x,
                                                     oa.apply_if_updated),
      GRAD_APPLY_UPDATES: train_steps.GradTrainer(tx, params, x),
  }


GIVEN_GRADIENT, GRAD_IN_STEP = "given gradient", "grad in step"


def _group(runner):
  if isinstance(runner, (train_steps.GradFloor, train_steps.GradTrainer)):
    return GRAD_IN_STEP
  return GIVEN_GRADIENT


def mean_gradient(runner):
  """The mean of the gradients a runner has accumulated so far."""
  if isinstance(runner, train_steps.Floor):
    return [a / runner.calls for a in runner.acc.values()]
  state = runner.state
  if isinstance(state, oa.AccumulateState):
    return [s / state.token_count for s in state.grad_sum.values()]
  return list(state.acc_grads.values())  # optax.MultiStepsState: a mean.


def correctness(runner, params, floor_mean):
  """Largest change a non-emitting step made, and its drift from the floor."""
  if isinstance(runner, (train_steps.Floor, train_steps.GradFloor)):
    return {}
  if isinstance(runner, train_steps.GradTrainer):
    return {"max_abs_update": harness.max_abs_diff(runner.params, params)}
  if isinstance(runner, train_steps.UpdateOnly):
    # It feeds its zero updates back as the next gradients, so only the
    # updates are comparable: they must be zero.
    return {"max_abs_update": harness.max_abs(runner.grads)}
  return {"max_abs_update": harness.max_abs_diff(runner.params, params),
          "mean_grad_rel_diff_vs_floor": harness.max_abs_diff(
              mean_gradient(runner), floor_mean) / harness.max_abs(floor_mean)}


def measure(runner, n):
  """Compile-time figures and page faults of one runner."""
  return {
      "hlo": {key: val for key, val in hlo_report.hlo_stats(
          runner.compiled.as_text()).items() if key != "per_computation"},
      "compiled": harness.memory(runner.compiled),
      "page_faults_per_call": harness.page_faults_per_call(runner, 2 * n),
  }


DEFAULTS, KEPT = "glibc malloc defaults", "freed memory kept"
# glibc's own switches: never map a block fresh (mmap_max=0), never give
# freed memory back (a trim threshold of 16 GiB), and keep one arena, so that
# a block freed by one thread is reused by the next call's (arena_max=1: with
# more, stray page faults remained).
KEEP_FREED = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
              "glibc.malloc.trim_threshold=17179869184")
ALLOCATORS = {DEFAULTS: {}, KEPT: {"GLIBC_TUNABLES": KEEP_FREED}}
_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")


def run(cfg):
  """:func:`measure_all` in two child processes, one per allocator setting."""
  return {"allocators": {
      name: harness.in_child(__file__, cfg, env, drop=_MALLOC_ENV)
      for name, env in ALLOCATORS.items()}, "keep_freed": KEEP_FREED}


def measure_all(cfg):
  params, grads = train_steps.param_tree(cfg["leaves"], cfg["size"])
  timed = runners(params, grads, train_steps.probe_batch(cfg["size"]))
  n = cfg["calls_per_rep"]
  summaries = {}
  # Two groups, each interleaved: the steps given their gradient, and the
  # slower ones that compute it (fewer repetitions).
  for group, reps in ((GIVEN_GRADIENT, cfg["reps"]),
                      (GRAD_IN_STEP, max(1, cfg["reps"] // 2))):
    times = harness.interleaved(
        {name: (lambda r=r: r.steps(n)) for name, r in timed.items()
         if _group(r) == group}, reps=reps)
    summaries.update(harness.summarize_times(times, per=n))
  out = {"leaves": cfg["leaves"], "shape": [cfg["size"], cfg["size"]],
         "param_bytes": harness.tree_bytes(params), "calls_per_rep": n,
         "candidates": {}}
  for name, r in timed.items():
    out["candidates"][name] = {**summaries[name], **measure(r, n)}
  floor_mean = mean_gradient(timed[FLOOR])
  for name, r in timed.items():
    out["candidates"][name].update(correctness(r, params, floor_mean))
  return out


def checks(result):
  out = []
  for allocator, res in result["allocators"].items():
    for name, c in res["candidates"].items():
      if "max_abs_update" in c:
        out.append(harness.Check(
            f"{name} ({allocator}): max abs update (never emits)",
            c["max_abs_update"], 0.0))
      if "mean_grad_rel_diff_vs_floor" in c:
        out.append(harness.Check(
            f"{name} ({allocator}): accumulated mean gradient vs the floor's"
            " (relative)", c["mean_grad_rel_diff_vs_floor"], 1e-5))
  return out


def _row(what, ours, floor, target):
  return report.Row(what, report.ms(ours), report.ms(floor),
                    f"{ours / floor:.2f}x",
                    "-" if target is None else f"<= {target}x",
                    target is None or ours / floor <= target)


def summary_rows(result):
  rows = []
  for allocator, res in result["allocators"].items():
    c = res["candidates"]
    median = lambda name, c=c: c[name]["median_s"]
    for name, label, target in (
        ("oa.accumulate update only", "tx.update alone", TARGET),
        (APPLY_IF_UPDATED, "tx.update + oa.apply_if_updated", TARGET),
        ("oa.accumulate train step", "tx.update + optax.apply_updates",
         None)):
      rows.append(_row(
          f"b. non-emitting micro-step ({label}) / floor jit(tree_map(add),"
          f" donated); {allocator}", median(name), median(FLOOR), target))
    rows.append(_row(
        "b. non-emitting train step computing its gradient (grad + tx.update"
        " + oa.apply_if_updated) / floor (grad + tree_map(add), donated);"
        f" {allocator}", median(GRAD_APPLY_IF_UPDATED), median(GRAD_FLOOR),
        TARGET))
  return rows


def markdown(result):
  first = next(iter(result["allocators"].values()))
  lines = [f"{first['leaves']} x {'x'.join(map(str, first['shape']))} f32, "
           "adamw inner, never emits.", "", DESCRIPTION, "",
           "Each setting runs in its own process: glibc's malloc as it comes,"
           " and with `GLIBC_TUNABLES="
           f"{result['keep_freed']}` (freed memory kept, as a GPU's"
           " allocator keeps it). With the defaults, every temporary over 32"
           " MiB is mapped fresh on each call: see the page faults.", ""]
  for allocator, res in result["allocators"].items():
    lines += [f"### {allocator}", ""] + _table(res)
  return lines


def _table(result):
  fl = result["candidates"][FLOOR]
  lines = ["| candidate | wall per call | / floor | CPU per call | / floor |"
           " page faults per call | temp | HLO copies (MiB) | fusions |"
           " conditionals |", "|---|---|---|---|---|---|---|---|---|---|"]
  for name, c in result["candidates"].items():
    h = c["hlo"]
    lines.append(
        f"| {name} | {report.ms(c['median_s'])} | "
        f"{c['median_s'] / fl['median_s']:.2f}x | "
        f"{report.ms(c['cpu_median_s'])} | "
        f"{c['cpu_median_s'] / fl['cpu_median_s']:.2f}x | "
        f"{c['page_faults_per_call']:.0f} | "
        f"{report.mib(c['compiled']['temp_bytes'])} | {h['copy']} "
        f"({h['copy_bytes'] / harness.MiB:.0f}) | {h['fusion']} | "
        f"{h['conditional']} |")
  return lines + [""]


if __name__ == "__main__":
  print(json.dumps(measure_all(json.loads(sys.argv[1]))))
