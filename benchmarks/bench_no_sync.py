"""h. One jit call per micro-batch (DDP ``no_sync``) on 8 simulated devices.

One optimizer update over ``k`` micro-batches, replicated parameters, the
batch sharded over a data axis of 8 CPU devices, three ways:

* ``jax.grad loop``: ``k`` jit calls of ``jax.grad`` + ``oa.accumulate``; XLA
  all-reduces the gradient in every call (``k`` per update);
* ``deferred loop``: ``k`` jit calls of ``oa.value_and_grad(...,
  gradient_sync="deferred")`` + ``oa.accumulate`` (no ``axis_name``: the
  types say which axes): the gradient sum stays unreduced and is
  all-reduced once, on the emitting call;
* ``one call``: ``oa.value_and_grad(num_microbatches=k, axis_name="data")``
  on the whole batch and the optimizer, in one jit call.

Collectives per update are read off the compiled programs (a loop's calls
times ``k``, its emitting branch once); time per update is interleaved
repetitions, blocking once per update. Checked: the three updates agree.
This process needs 8 devices: with fewer, ``run`` starts itself in a
subprocess with ``jax_num_cpu_devices=8``.
"""

import collections
import json
import re
import sys

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax

import harness
import hlo_report
import optax_accum as oa
import report
from zoo import models

KEY = "h"
TITLE = "One jit call per micro-batch (DDP no_sync): deferred gradient sync"
DEVICES = 8
CONFIGS = {
    "full": {"k": 8, "reps": 15, "model": {
        "batch_size": 1024, "d_in": 512, "width": 1024, "depth": 4,
        "d_out": 64}},
    "quick": {"k": 8, "reps": 5, "model": {
        "batch_size": 512, "d_in": 256, "width": 512, "depth": 3,
        "d_out": 32}},
    "toy": {"k": 2, "reps": 1, "model": {
        "batch_size": 32, "d_in": 8, "width": 16, "depth": 2, "d_out": 4}},
}
NAIVE, DEFERRED, ONE_CALL = "jax.grad loop", "deferred loop", "one call"
# Most of the jax.grad loop's time per update the deferred loop may take.
TIME_TARGET = 1.0


_REGION_OF = {"body": "in_loop", "condition": "in_loop",
              "branch_computations": "in_branch",
              "true_computation": "in_branch",
              "false_computation": "in_branch"}


# An all-reduce of more bytes than this is counted as gradient-sized; the
# loss and token count (two float32 scalars) are below it.
SCALARS_BYTES = 16


def all_reduce_bytes(compiled):
  """Bytes all-reduced, and gradient-sized all-reduces, by region.

  ``({"outside": ..., "in_loop": ..., "in_branch": ...}, same for counts)``:
  a loop body's all-reduces run once per iteration, a branch's when it is
  taken.
  """
  comps, entry = hlo_report.parse_computations(compiled.as_text())
  out = collections.Counter({"outside": 0, "in_loop": 0, "in_branch": 0})
  large = collections.Counter({"outside": 0, "in_loop": 0, "in_branch": 0})

  def visit(name, region, path):
    for line in comps.get(name, ()):
      m = hlo_report._INSTR.match(line)
      if m and m.group(3) in ("all-reduce", "all-reduce-start"):
        size = sum(hlo_report.shape_bytes(s) for s in re.findall(
            r"\w+\[[\d,]*\]", m.group(2)))
        out[region] += size
        large[region] += size > SCALARS_BYTES
      for key, inner in _REGION_OF.items():
        for callee in hlo_report._called(line, key):
          if callee not in path:
            visit(callee, inner if region == "outside" else region,
                  path | {name})

  visit(entry, "outside", frozenset())
  return dict(out), dict(large)


def _per_update(counts, k, loop_calls):
  """All-reduces (and bytes) per update: ``k`` calls, or one call's loop."""
  if loop_calls:
    return k * counts["outside"] + counts["in_branch"]
  return counts["outside"] + k * counts["in_loop"]


def _programs(model, k):
  """The three candidates' compiled programs, their inputs and a runner."""
  params, batch, loss_fn = models.make_mlp(**model)
  params = jax.device_put(params, P())
  micro = [jax.device_put(jax.tree.map(lambda x, i=i: x[i::k], batch),
                          P("data")) for i in range(k)]
  whole = jax.device_put(batch, P("data"))
  sgd = optax.sgd(0.1)
  naive_tx = oa.accumulate(sgd, every_k=k, equal_weights=True)
  deferred_tx = oa.accumulate(sgd, every_k=k, equal_weights=True)
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1, axis_name="data",
                              gradient_sync="deferred", equal_weights=True)
  one_call_fn = oa.value_and_grad(loss_fn, num_microbatches=k,
                                  axis_name="data", equal_weights=True)

  def naive(p, s, b):
    u, s = naive_tx.update(jax.grad(loss_fn)(p, b), s, p)
    return optax.apply_updates(p, u), s

  def deferred(p, s, b):
    u, s = deferred_tx.update(grad_fn(p, b)[1], s, p)
    return optax.apply_updates(p, u), s

  def one_call(p, s, b):
    u, s = sgd.update(one_call_fn(p, b)[1], s, p)
    return optax.apply_updates(p, u), s

  # The deferred sum is typed like the gradient from its first call on: a
  # state after one cycle (micro_step 0 again) compiles the timed program.
  deferred_state = deferred_tx.init(params)
  for b in micro:
    deferred_state = jax.jit(deferred)(params, deferred_state, b)[1]
  states = {NAIVE: naive_tx.init(params), DEFERRED: deferred_state,
            ONE_CALL: sgd.init(params)}
  steps = {NAIVE: naive, DEFERRED: deferred, ONE_CALL: one_call}
  inputs = {NAIVE: micro, DEFERRED: micro, ONE_CALL: [whole]}
  compiled = {name: jax.jit(f).lower(params, states[name], inputs[name][0])
              .compile() for name, f in steps.items()}
  return params, states, inputs, compiled


def _in_process(cfg):
  k = cfg["k"]
  mesh = jax.make_mesh((DEVICES,), ("data",),
                       axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params, states, inputs, compiled = _programs(cfg["model"], k)

    updated, times = harness.time_updates(
        {name: (lambda n=name: harness.update_by_calls(
            compiled[n], params, states[n], inputs[n])) for name in compiled},
        reps=cfg["reps"])
  out = {"k": k, "model": cfg["model"], "devices": DEVICES,
         "param_bytes": harness.tree_bytes(params),
         "candidates": harness.summarize_times(times), "collectives": {}}
  for name, c in compiled.items():
    counts = oa.count_collectives(c)
    regions = {r: sum(getattr(counts, r).values())
               for r in ("outside", "in_loop", "in_branch")}
    loop_calls = name != ONE_CALL
    reduced_bytes, gradient_sized = all_reduce_bytes(c)
    out["collectives"][name] = {
        "per_call": counts._asdict(),
        "collectives_per_update": _per_update(regions, k, loop_calls),
        "gradient_all_reduces_per_update": _per_update(
            gradient_sized, k, loop_calls),
        "all_reduce_bytes_per_update": _per_update(
            reduced_bytes, k, loop_calls)}
  out["max_abs_diff_vs_one_call"] = {
      name: harness.max_abs_diff(p, updated[ONE_CALL])
      for name, p in updated.items()}
  out["max_abs_param"] = harness.max_abs(updated[ONE_CALL])
  return out


def run(cfg):
  if jax.device_count() >= DEVICES:
    return _in_process(cfg)
  # jax has started with fewer devices: measure in a fresh process.
  return harness.in_child(__file__, cfg)


def checks(result):
  scale = max(result["max_abs_param"], 1.0)
  return [harness.Check(f"h. {name}: max abs param diff vs one call / scale",
                        diff / scale, 1e-5)
          for name, diff in result["max_abs_diff_vs_one_call"].items()]


def _median(result, name):
  return result["candidates"][name]["median_s"]


def summary_rows(result):
  k = result["k"]
  ours, naive = _median(result, DEFERRED), _median(result, NAIVE)
  c = result["collectives"]
  return [
      report.Row(f"h. time per update, deferred loop / jax.grad loop (k={k})",
                 report.ms(ours), report.ms(naive), f"{ours / naive:.2f}x",
                 f"<= {TIME_TARGET}x", ours / naive <= TIME_TARGET),
      report.Row(f"h. bytes all-reduced per update, deferred / jax.grad"
                 f" loop (k={k})",
                 report.mib(c[DEFERRED]["all_reduce_bytes_per_update"]),
                 report.mib(c[NAIVE]["all_reduce_bytes_per_update"]),
                 f"{c[DEFERRED]['all_reduce_bytes_per_update'] / max(c[NAIVE]['all_reduce_bytes_per_update'], 1):.3f}x",  # noqa: E501
                 f"<= {1.5 / k:.3f}x",
                 c[DEFERRED]["all_reduce_bytes_per_update"]
                 <= 1.5 / k * c[NAIVE]["all_reduce_bytes_per_update"]),
  ]


def markdown(result):
  k, one = result["k"], _median(result, ONE_CALL)
  lines = [
      f"One update over k={k} micro-batches on {result['devices']} simulated"
      f" CPU devices, `{report.spec(result['model'])}` (params"
      f" {report.mib(result['param_bytes'])}). Per update: collectives in"
      " the compiled programs (a loop's k calls, its emitting branch once),"
      " the bytes they all-reduce, and the median time (p25-p75):",
      "",
      "| | collectives | gradient-sized all-reduces | all-reduced | time |"
      " vs one call |",
      "|---|---|---|---|---|---|",
  ]
  for name in (NAIVE, DEFERRED, ONE_CALL):
    c, t = result["collectives"][name], result["candidates"][name]
    lines.append(
        f"| {name} | {c['collectives_per_update']} |"
        f" {c['gradient_all_reduces_per_update']} |"
        f" {report.mib(c['all_reduce_bytes_per_update'])} |"
        f" {report.ms(t['median_s'])} ({report.ms(t['p25_s'])}-"
        f"{report.ms(t['p75_s'])}) | {t['median_s'] / one:.2f}x |")
  return lines


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(_in_process(json.loads(sys.argv[1]))))
