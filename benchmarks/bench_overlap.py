"""q. Hiding the one reduction (SPEC 13): overlap, peak, compile time.

Compiled for 8 compile-only devices (benchmark k's: a TPU v5e ``2x4``
slice, and 8 H100s with the ``gpu`` extra), nothing run, on benchmark k's
decoder (``zoo/typed_model.py``). Candidates, one update of ``k``
micro-batches in one call each:

* ``ours``: ``oa.value_and_grad`` in the typed form, the last micro-batch
  after the loop (SPEC 13): asked for with ``overlap_reduction=True`` where
  the library takes that argument (:data:`OPT_IN`), else where the
  compiler overlaps (GPUs; TPUs with :data:`TPU_OVERLAP_FLAGS`);
* ``today``: the same with the last micro-batch kept in the loop (the
  release before SPEC 13): ``overlap_reduction=False``, or
  ``trip_count.where_it_overlaps`` replaced by its ``plain`` branch while
  tracing;
* ``scan``: the hand-written token-weighted ``lax.scan`` of ``jax.grad``
  (``zoo/peers.py``), reducing after its loop;
* ``MultiSteps``: ``jax.grad`` of one micro-batch per jitted call fed to
  ``optax.MultiSteps`` (benchmark k's, parameters and state donated): it
  reduces in every call, and XLA may overlap each call's reduction with
  that call's backward; its bytes per update are k calls';
* ``peeled anyway`` (by default only with libtpu's defaults, where ours keeps
  the loop whole): the last micro-batch after the loop whatever the
  compiler, what the peel alone costs there.

Meshes: benchmark k's ``data x tensor`` (4 x 2) and ``fsdp`` (8), and on 8
data-parallel devices ``data`` (parameters replicated) and ``ZeRO-1``
(``param_specs=oa.zero_specs(...)``, ``gradient_sync="once"``). The model's
positional embedding is broadcast before its add (``pos_broadcast``): a leaf
JAX keeps replicated is reduced in every micro-batch, and then the last
micro-batch stays in the loop.

Per candidate: ``oa.reduction_overlap`` (the share of the gradient
reduction's bytes that start asynchronously before the last matrix
multiply, and the flops scheduled between each start and done),
``peak_memory_in_bytes`` per device, the wall time of tracing and lowering
and of compiling (the candidates' compiles interleaved in one process,
``jax.clear_caches()`` before each), the data-axis reductions counted by
``oa.count_collectives`` (scalars left out) and their bytes per update
(benchmark k's reading), and, in the micro-batch loop's body, what
produces each float32 running sum (issue 51, item 5): the weight-gradient
matrix multiply with the add fused in (XLA TPU: an ``add`` at the root of
the convolution fusion; XLA GPU: an ``add`` at the root of a Triton gemm
fusion, or a cuBLAS gemm with ``beta`` = 1), or a separate elementwise pass
over the gradient.

The compile times are one compile each (``repeats`` for more, in rotated
order): the first large compile of a process is the slowest, so compare
them with care. With ``"hlo_dir"`` in the configuration each program's
text is written there. Each compiler setting runs in its own child
process (``LIBTPU_INIT_ARGS`` is read once, when libtpu loads;
``XLA_FLAGS`` when jax starts; the CUDA plugin's compile-only GPUs need jax
started on the CPU platform)::

  python benchmarks/bench_overlap.py '{"compiler": "TPU v5e, overlap flags",
                                        ...}'
"""

import inspect
import json
import math
import os
import re
import sys
import time
import warnings

import jax
from jax.sharding import PartitionSpec as P

import bench_compiled
import harness
import optax_accum as oa
from optax_accum._src.microbatch import trip_count
from optax_accum._src.tools import hlo_text
import report
from zoo import compile_only as co
from zoo import peers
from zoo import typed_model as tm

KEY = "q"
TITLE = "Hiding the one reduction (SPEC 13): overlap, peak and compile time"
TOPOLOGY = "v5e:2x4"
# What makes XLA's TPU compiler (libtpu 0.0.42.1) issue each leaf's
# all-reduce asynchronously: trip_count.TPU_OVERLAP_FLAGS and a combiner
# that merges no two (docs/performance.md).
TPU_OVERLAP_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true"
    " --xla_enable_async_all_reduce=true"
    " --xla_jf_crs_combiner_threshold_count=1")
GPU_NO_COMBINING = "--xla_gpu_all_reduce_combine_threshold_bytes=0"
# Compiler setting -> (platform, environment of its child, names dropped).
COMPILERS = {
    "TPU v5e, overlap flags": ("tpu", {"LIBTPU_INIT_ARGS": TPU_OVERLAP_FLAGS},
                               ()),
    "TPU v5e, defaults": ("tpu", {}, ("LIBTPU_INIT_ARGS",)),
    "H100, defaults": ("gpu", {}, ("XLA_FLAGS",)),
    "H100, no combining": ("gpu", {"XLA_FLAGS": GPU_NO_COMBINING}, ()),
}
# Whether the peel is asked for (``overlap_reduction=``) or chosen by the
# compiler (``trip_count.where_it_overlaps``, replaced while tracing).
OPT_IN = "overlap_reduction" in inspect.signature(
    oa.value_and_grad).parameters
OURS, TODAY, SCAN = "ours", "today", "scan"
# The last micro-batch after the loop whatever the compiler: what the peel
# alone costs where ours keeps it in the loop (TPU defaults, the CPU).
PEELED = "peeled anyway"
MULTISTEPS = bench_compiled.MULTISTEPS
CANDIDATES = (OURS, TODAY, SCAN, MULTISTEPS, PEELED)
# Benchmark k's sizes, the positional embedding broadcast before its add
# (``pos_broadcast``): otherwise JAX keeps that leaf replicated and reduces
# it in each micro-batch, and the last micro-batch stays in the loop
# (``reduces_only_after_loop``).
_MODEL_1B = {"vocab": 32768, "seq": 1024, "dim": 4096, "heads": 32,
             "ffn": 16384, "layers": 4, "pos_broadcast": True}
CONFIGS = {
    "full": {"k": 8, "batch": 64, "repeats": 1, "model": _MODEL_1B,
             "meshes": ["data x tensor", "fsdp"],
             "compilers": list(COMPILERS)},
    "quick": {"k": 8, "batch": 64, "repeats": 1, "model": {
        "vocab": 32768, "seq": 1024, "dim": 2048, "heads": 16, "ffn": 8192,
        "layers": 2, "pos_broadcast": True},
              "meshes": ["data x tensor", "fsdp"],
              "compilers": list(COMPILERS)},
    "toy": {"k": 2, "batch": 32, "repeats": 1, "model": {
        "vocab": 64, "seq": 8, "dim": 32, "heads": 4, "ffn": 64,
        "layers": 1, "pos_broadcast": True}, "meshes": ["data x tensor"],
            "compilers": ["TPU v5e, overlap flags"]},
}
# Issue 51's targets: share >= 80% where the compiler overlaps; peak within
# 1% of today's and of the scan's; compile time within 1.5x of today's.
SHARE_TARGET, PEAK_TARGET, COMPILE_TARGET = 0.8, 1.01, 1.5


# Benchmark k's meshes, and on 8 data-parallel devices the parameters
# replicated ("data") or, with ZeRO-1, the gradient reduce-scattered into
# oa.zero_specs's shards (gradient_sync="once").
MESHES = {**bench_compiled.MESHES,
          "data": ((8,), ("data",), {"batch_axes": ("data",)}),
          "ZeRO-1": ((8,), ("data",), {"batch_axes": ("data",)})}


def _problem(name, cfg_run, devices):
  """The mesh, the data axes and each candidate's function and arguments."""
  k = cfg_run["k"]
  cfg, mesh, data_axes, n_data, shapes, params, _, batch = (
      bench_compiled.problem(MESHES[name], cfg_run, devices))
  loss_fn = tm.loss_fn(cfg)
  zero = {}
  if OPT_IN:  # ours asks for the peel; today and the scan do not.
    step_of = {OURS: True, TODAY: False, PEELED: True}
  if name == "ZeRO-1":
    with jax.set_mesh(mesh):
      zero = {"param_specs": oa.zero_specs(params, "data"),
              "gradient_sync": "once"}
  whole = (params, batch)
  steps = {SCAN: (peers.token_weighted_scan(loss_fn, k, data_axes, n_data),
                  whole, ())}
  for cand in (OURS, TODAY, PEELED):
    asked = {"overlap_reduction": step_of[cand]} if OPT_IN else {}
    steps[cand] = (oa.value_and_grad(loss_fn, num_microbatches=k,
                                     num_tokens_fn=tm.num_tokens, **zero,
                                     **asked), whole, ())
  micro = co.abstract(
      jax.eval_shape(lambda: tm.batch(cfg, cfg_run["batch"] // k)), mesh,
      jax.tree.map(lambda _: P(data_axes), batch))
  tx, micro_step = bench_compiled._multisteps(loss_fn, k)
  with jax.set_mesh(mesh):
    state = jax.eval_shape(tx.init, params)
  steps[MULTISTEPS] = (micro_step, (params, state, micro), (0, 1))
  return mesh, data_axes, shapes, steps


def _compile(mesh, fn, args, cand, donate=()):
  """``(compiled, seconds to trace and lower, seconds to compile)``.

  ``where_it_overlaps`` takes its ``plain`` branch (the last micro-batch in
  the loop) while ``TODAY`` traces, its other one while ``PEELED`` does.
  """
  jax.clear_caches()
  chosen = getattr(trip_count, "where_it_overlaps", None)
  if cand == TODAY and not OPT_IN:
    trip_count.where_it_overlaps = lambda plain, last_after: plain()
  elif cand == PEELED and not OPT_IN:
    trip_count.where_it_overlaps = lambda plain, last_after: last_after()
  try:
    with jax.set_mesh(mesh), warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)  # the fallback leaf.
      start = time.perf_counter()
      lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
      lowered_at = time.perf_counter()
      compiled = lowered.compile()
      done = time.perf_counter()
  finally:
    if chosen is not None:
      trip_count.where_it_overlaps = chosen
  return compiled, lowered_at - start, done - lowered_at


def _overlap(compiled, mesh, data_axes):
  r = oa.reduction_overlap(compiled, data_axes=data_axes, mesh=mesh)
  return {"share": r.overlapped_share, "reductions": r.num_reductions,
          "overlapped_bytes": r.overlapped_bytes,
          "total_bytes": r.total_bytes,
          "flops_between": sum(x.flops_between for x in r.reductions),
          "each": [[x.collective, x.nbytes, x.asynchronous,
                    x.starts_before_last_matmul, x.flops_between]
                   for x in r.reductions]}


def _collectives(compiled, mesh, data_axes):
  """The data-axis reductions by ``oa.count_collectives`` (no scalars)."""
  counts = oa.count_collectives(compiled, mesh=mesh, include_scalars=False)
  out = {"in_loop": {}, "outside": {}, "in_branch": {}}
  for axes, c in counts.by_axes.items():
    if not set(axes) & set(data_axes):
      continue
    for where in out:
      for name, n in getattr(c, where).items():
        if name in ("all-reduce", "reduce-scatter"):
          out[where][name] = out[where].get(name, 0) + n
  return out


# --- Item 5: what produces each running sum in the loop's body -------------

_BODY = re.compile(r"\bbody=%?([^\s,)]+)")
_CALLS = re.compile(r"\bcalls=%?([^\s,)]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BETA = re.compile(r'"beta":\s*([0-9.eE+-]+)')
_MATMULS = ("convolution", "dot")
# Followed to their operand: XLA TPU moves a sum between memories with an
# asynchronous copy (copy-start, copy-done).
_PASS = ("bitcast", "get-tuple-element", "copy", "copy-start", "copy-done")
_MIN_SUM_BYTES = 4096  # smaller carries are counters and scalar sums.


def _instructions(computation):
  return {hlo_text._name(line): (opcode, rest, line)
          for opcode, rest, line in computation}


def _operands(rest):
  found = hlo_text._OPERANDS.match(rest)
  if not found or not found.group(1).strip():
    return []
  listed = re.sub(r"/\*.*?\*/", "", found.group(1))  # /*index=5*/
  return [part.split()[-1].lstrip("%")
          for part in listed.split(",") if part.strip()]


def _has(computations, name, opcodes, seen=None):
  """Whether computation ``name`` (or a fusion it calls) holds ``opcodes``."""
  seen = set() if seen is None else seen
  if name in seen:
    return False
  seen.add(name)
  for opcode, rest, _ in computations.get(name, ()):
    if opcode in opcodes:
      return True
    callee = _CALLS.search(rest)
    if opcode == "fusion" and callee and _has(computations, callee.group(1),
                                              opcodes, seen):
      return True
  return False


def _root_op(computations, name, index):
  """The opcode that computes output ``index`` of computation ``name``."""
  body = computations.get(name, ())
  if not body:
    return None
  table = _instructions(body)
  opcode, rest, line = next(
      (op for op in body if op[2].lstrip().startswith("ROOT")), body[-1])
  if opcode == "tuple" and index is not None:
    opcode, rest, line = table.get(_operands(rest)[index], (opcode, rest,
                                                            line))
  while opcode == "bitcast":
    opcode, rest, line = table.get(_operands(rest)[0], (None, "", ""))
  if opcode == "fusion":  # a nested fusion: its own root.
    callee = _CALLS.search(rest)
    return _root_op(computations, callee.group(1), None) if callee else None
  return opcode


def _producer(computations, body, name):
  """How the loop body computes carry element ``name``."""
  table = _instructions(computations[body])
  index, copied = None, False
  while name in table:
    opcode, rest, line = table[name]
    if opcode == "parameter":
      return "passed through"
    if opcode == "get-tuple-element":
      found = _INDEX.search(rest)
      operand = _operands(rest)[0]
      if table.get(operand, ("",))[0] == "parameter":
        return "passed through"
      index = int(found.group(1)) if found else None
      name = operand
      continue
    if opcode in _PASS:
      copied = copied or opcode == "copy"  # a copy-done moves, not adds.
      name = _operands(rest)[0]
      continue
    break
  else:
    return "unknown"
  suffix = " (then copied)" if copied else ""
  if opcode == "custom-call":
    target = _TARGET.search(rest)
    target = target.group(1) if target else "?"
    if "gemm" in target or "matmul" in target:
      beta = _BETA.search(line)
      fused = beta is not None and float(beta.group(1)) != 0.0
      return ("fused: gemm with beta=1" if fused else "gemm, add apart") + (
          suffix)
    return f"custom-call {target}{suffix}"
  if opcode == "fusion":
    callee = _CALLS.search(rest).group(1)
    matmul = _has(computations, callee, _MATMULS)
    root = _root_op(computations, callee, index)
    if matmul and root == "add":
      return "fused: add in the matmul's fusion" + suffix
    if matmul:
      return f"matmul fusion, root {root}" + suffix
    if root == "add" and _has(computations, callee, ("reduce",)):
      return "fused: add in the gradient's reduction" + suffix
    if _has(computations, callee, ("scatter",)):
      return "scatter-add into the sum" + suffix
    if root == "add" or _has(computations, callee, ("add",)):
      return "separate: elementwise add fusion" + suffix
    return f"fusion, root {root}" + suffix
  if opcode == "add":
    return "separate: add" + suffix
  return opcode + suffix


def accumulation_adds(text):
  """For the while loop with the most float32 running sums: what produces
  each (``[[shape, how], ...]``, in carry order) and their counts."""
  _, computations = hlo_text._parse(text)
  best = []
  for computation in computations.values():
    for opcode, rest, _ in computation:
      found = _BODY.search(rest)
      if opcode != "while" or not found or found.group(1) not in computations:
        continue
      body = found.group(1)
      table = _instructions(computations[body])
      root = next((op for op in computations[body]
                   if op[2].lstrip().startswith("ROOT")), None)
      if root is None or root[0] != "tuple":
        continue
      sums = []
      for operand in _operands(root[1]):
        if operand not in table:
          continue
        shapes = hlo_text._result_shapes(table[operand][2])
        if len(shapes) != 1 or shapes[0][0] != "f32":
          continue
        nbytes = 4 * math.prod(shapes[0][1])
        how = _producer(computations, body, operand)
        if nbytes >= _MIN_SUM_BYTES and how != "passed through":
          sums.append([f"f32{shapes[0][1]}", nbytes, how])
      if len(sums) > len(best):
        best = sums
  counts = {}
  for _, _, how in best:
    kind = how.split(":")[0] if ":" in how else (
        "scatter-add" if how.startswith("scatter") else "other")
    counts[kind] = counts.get(kind, 0) + 1
  # Per parameter and micro-step, over the sums a matmul's gradient feeds:
  # fused, the sum read and written (8 B); apart, the float32 gradient read
  # besides (12 B). A scatter-add (the embedding) touches only its rows.
  fused = sum(n for _, n, how in best if how.startswith("fused"))
  apart = sum(n for _, n, how in best if how.startswith("separate"))
  return {"sums": best, "counts": counts,
          "bytes_per_parameter": (8 * fused + 12 * apart) / (fused + apart)
                                 if fused + apart else None}


# --- The child process: one compiler setting --------------------------------

def _warm_up(mesh):
  """One small compile first: the compiler's start-up is no candidate's."""
  x = jax.ShapeDtypeStruct((8, 128), jax.numpy.float32,
                           sharding=jax.NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile()


def _mesh_run(name, cfg_run, devices):
  mesh, data_axes, shapes, steps = _problem(name, cfg_run, devices)
  _warm_up(mesh)
  k = cfg_run["k"]
  cands = cfg_run.get("candidates", list(
      CANDIDATES if not _overlaps_here(cfg_run["compiler"])
      else CANDIDATES[:4]))
  out = {"params": int(sum(x.size for x in jax.tree.leaves(shapes))),
         "param_bytes": harness.tree_bytes(shapes),
         "leaves": len(jax.tree.leaves(shapes)),
         "candidates": {c: {"lower_s": [], "compile_s": []} for c in cands}}
  for rep in range(cfg_run["repeats"]):
    order = cands[rep % len(cands):] + cands[:rep % len(cands)]
    for cand in order:
      x = out["candidates"][cand]
      try:
        fn, args, donate = steps[cand]
        compiled, lower_s, compile_s = _compile(mesh, fn, args, cand,
                                                donate)
      except jax.errors.JaxRuntimeError as e:
        if getattr(e, "error_code_string", None) != "RESOURCE_EXHAUSTED":
          raise
        x["refused"] = str(e).splitlines()[0][:300]
        continue
      x["lower_s"].append(lower_s)
      x["compile_s"].append(compile_s)
      print(f"q. {name}, {cand}: compiled in {compile_s:.1f} s",
            file=sys.stderr, flush=True)
      if rep:
        continue
      x.update(bench_compiled._measure(compiled, mesh, data_axes, k,
                                       cand == MULTISTEPS))
      x["overlap"] = _overlap(compiled, mesh, data_axes)
      x["collectives"] = _collectives(compiled, mesh, data_axes)
      text = compiled.as_text()
      x["loop_sums"] = accumulation_adds(text)
      if cfg_run.get("hlo_dir"):  # to read again without compiling.
        path = os.path.join(cfg_run["hlo_dir"], f"{cfg_run['compiler']}"
                            f" {name} {cand}.hlo".replace(" ", "_"))
        with open(path, "w") as f:
          f.write(text)
  return out


def _in_process(cfg):
  platform = COMPILERS[cfg["compiler"]][0]
  if platform == "gpu":
    topology, devices = "8 x H100 SXM", co.gpu_devices()
  else:
    topology, devices = TOPOLOGY, co.tpu_devices(TOPOLOGY)
  return {"topology": topology, "device_kind": devices[0].device_kind,
          "jax": jax.__version__, "load": harness.load_average(),
          "meshes": {name: _mesh_run(name, cfg, devices)
                     for name in cfg["meshes"]}}


def run(cfg):
  out = {"k": cfg["k"], "batch": cfg["batch"], "model": cfg["model"],
         "compilers": {}, "skipped": {}}
  for setting in cfg["compilers"]:
    platform, env, drop = COMPILERS[setting]
    missing = co.missing_gpu() if platform == "gpu" else co.missing_tpu()
    if missing:
      out["skipped"][setting] = missing
      continue
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **env}
    if platform == "gpu":
      env["JAX_PLATFORMS"] = "cpu"
    out["compilers"][setting] = harness.in_child(
        __file__, {**cfg, "compiler": setting}, env=env, drop=drop)
  return out


# --- Report -------------------------------------------------------------------

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


def _overlaps_here(setting):
  return setting != "TPU v5e, defaults"


def checks(result):
  out = []
  for setting, r in result["compilers"].items():
    for name, m in r["meshes"].items():
      c = m["candidates"]
      if "overlap" in c.get(OURS, {}) and "overlap" in c.get(TODAY, {}):
        out.append(harness.Check(
            f"q. {setting}, {name}: ours's gradient bytes per update /"
            " today's", c[OURS]["per_update_bytes"]
            / max(c[TODAY]["per_update_bytes"], 1), 1.0))
  return out or [harness.Check("q. nothing compiled", 0, 0)]


def summary_rows(result):
  rows = []
  for setting, r in result["compilers"].items():
    for name, m in r["meshes"].items():
      c = m["candidates"]
      if "overlap" not in c.get(OURS, {}):
        continue
      share = c[OURS]["overlap"]["share"]
      if _overlaps_here(setting):
        rows.append(report.Row(
            f"q. {setting}, {name}: reduction bytes overlapped, ours",
            f"{share:.1%}", f"{c[SCAN]['overlap']['share']:.1%}"
            if "overlap" in c.get(SCAN, {}) else "-", "-",
            f">= {SHARE_TARGET:.0%}",
            share >= SHARE_TARGET))
      for peer in (TODAY, SCAN):
        ratio = _ratio(c, OURS, peer, "peak_bytes")
        if ratio is not None:
          rows.append(report.Row(
              f"q. {setting}, {name}: peak per device, ours / {peer}",
              report.mib(c[OURS]["peak_bytes"]),
              report.mib(c[peer]["peak_bytes"]), f"{ratio:.3f}x",
              f"<= {PEAK_TARGET}x", ratio <= PEAK_TARGET))
      ratio = _compile_ratio(c, OURS, TODAY)
      if ratio is not None:
        rows.append(report.Row(
            f"q. {setting}, {name}: compile time, ours / today",
            f"{_median(c[OURS]['compile_s']):.1f} s",
            f"{_median(c[TODAY]['compile_s']):.1f} s", f"{ratio:.2f}x",
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
  if not s["sums"]:
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
      for cand in CANDIDATES:
        if "refused" in c.get(cand, {}):
          lines.append(f"| {setting} | {name} | {cand} | refused:"
                       f" {c[cand]['refused']} |" + " |" * 11)
        if "overlap" not in c.get(cand, {}):
          continue
        x, o = c[cand], c[cand]["overlap"]
        n_async = sum(e[2] for e in o["each"])
        n_before = sum(e[2] and e[3] for e in o["each"])
        ratios = [_ratio(c, cand, p, "peak_bytes") for p in (TODAY, SCAN)]
        lines.append(
            f"| {setting} | {name} | {cand} | {o['share']:.1%} |"
            f" {o['reductions']} ({n_async}, {n_before}) |"
            f" {o['flops_between'] / 1e9:.1f} |"
            f" {report.mib(x['peak_bytes'])} |"
            + "".join(f" {'-' if q is None else f'{q:.3f}x'} |"
                      for q in ratios)
            + f" {_median(x['compile_s']):.1f} |"
            f" {bench_compiled._times(_compile_ratio(c, cand, TODAY))} |"
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
      " each float32 running sum in the micro-batch loop's body (issue 51,"
      " item 5).", ""]
  for setting, why in result["skipped"].items():
    lines += [f"Skipped {setting}: {why}", ""]
  return lines + table(result)


if __name__ == "__main__":
  config = json.loads(sys.argv[1])
  if COMPILERS[config["compiler"]][0] == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  print(json.dumps(_in_process(config), default=str))
