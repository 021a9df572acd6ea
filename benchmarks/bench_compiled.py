"""k. Compiled for TPU v5e chips: memory and data reductions, nothing run.

SPEC 11: XLA compiles for hardware this machine lacks. With libtpu installed
(``pip install -e ".[tpu]"``), ``jax.experimental.topologies`` gives the 8
compile-only chips of a TPU v5e ``2x4`` slice; every candidate is lowered
from abstract inputs (``jax.ShapeDtypeStruct`` sharded over them) and
compiled by XLA's TPU compiler, and its program is read: per-chip memory
and the bytes of gradient that reductions over the data axes sum per update
(all-reduces and reduce-scatters of 64 bytes or more; a reduce-scatter
counts the whole gradient it sums; in a loop x k).

Memory is read as XLA spends it: ``memory_analysis().peak_memory_in_bytes``
(each buffer once, arguments and outputs included), with ratios to the
plain scan's and to ``optax.MultiSteps``'s. Temp (``temp_size_in_bytes``,
the scratch allocation, which counts again the output buffers XLA lends to
loop temporaries) and arguments (parameters, optimizer state and batch,
passed in) are secondary columns.

The model is the cookbook-style decoder of ``zoo/typed_model.py`` at about
1B parameters, on two meshes: ``data x tensor`` (4 x 2) and ``fsdp`` (8).
Candidates, one update of ``k`` micro-batches each:

* ``full batch``: ``jax.jit(jax.value_and_grad(loss_fn))``;
* ``typed``: ``oa.value_and_grad`` on Explicit axes;
* ``shard_map``: ``oa.value_and_grad(axis_name=...)`` on Auto axes (the
  model without activation annotations);
* ``plain scan``: a token-weighted ``lax.scan`` of ``jax.grad``;
* ``MultiSteps``: ``jax.grad`` of one micro-batch per jitted call, fed to
  ``optax.MultiSteps`` (per update: k calls), parameters and state donated;
* ``accumulate``: the same ``jax.grad`` fed to ``oa.accumulate``, applied
  with ``oa.apply_if_updated``: MultiSteps's own peer, donated;
* ``update_and_apply``: the same, applied by ``oa.update_and_apply`` in
  the emitting step (SPEC 11's copy-free emit), donated;
* ``deferred``: ``oa.value_and_grad(gradient_sync="deferred")`` and
  ``oa.accumulate(axis_name=...)``, one micro-batch per call, applied with
  ``oa.apply_if_updated``, donated.

And which loop patterns XLA's TPU compiler moves out of the loop by itself
(``data x tensor``): the plain scan; a bf16 cast of the gradient added into
an f32 carry; a clipped carry; a NaN-guarded carry. Without libtpu the
section records why it was skipped.

With ``"compiler": "gpu"`` in the configuration (and the ``gpu`` extra),
the same programs are compiled for 8 compile-only H100s instead, by XLA's
GPU compiler, in a child process that starts jax on the CPU platform::

  python benchmarks/bench_compiled.py '{"compiler": "gpu", "k": 8, ...}'
"""

import json
import math
import sys
from typing import Any, NamedTuple
import warnings

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax

import harness
import optax_accum as oa
import report
from zoo import compile_only as co
from zoo import peers
from zoo import typed_model as tm

KEY = "k"
TITLE = "Compiled for TPU v5e (2x4): memory and data reductions at 1B"
TOPOLOGY = "v5e:2x4"
CONFIGS = {
    "full": {"k": 8, "batch": 64, "patterns": True,
             "meshes": ["data x tensor", "fsdp"], "model": {
        "vocab": 32768, "seq": 1024, "dim": 4096, "heads": 32,
        "ffn": 16384, "layers": 4}},
    "quick": {"k": 8, "batch": 64, "patterns": True,
              "meshes": ["data x tensor", "fsdp"], "model": {
        "vocab": 32768, "seq": 1024, "dim": 2048, "heads": 16,
        "ffn": 8192, "layers": 2}},
    "toy": {"k": 2, "batch": 32, "patterns": False,
            "meshes": ["data x tensor"], "model": {
        "vocab": 64, "seq": 8, "dim": 32, "heads": 4, "ffn": 64,
        "layers": 1}},
}
MESHES = {
    "data x tensor": ((4, 2), ("data", "tensor"),
                      {"batch_axes": ("data",), "tensor": "tensor"}),
    "fsdp": ((8,), ("fsdp",), {"batch_axes": ("fsdp",), "fsdp": "fsdp"}),
}
FULL, TYPED, SHARD_MAP, SCAN = "full batch", "typed", "shard_map", "plain scan"
MULTISTEPS, ACCUMULATE, DEFERRED = "MultiSteps", "accumulate", "deferred"
FUSED = "update_and_apply"
CANDIDATES = (FULL, TYPED, SHARD_MAP, SCAN, MULTISTEPS, ACCUMULATE, FUSED,
              DEFERRED)
PER_CALL = (MULTISTEPS, ACCUMULATE, FUSED, DEFERRED)
PATTERNS = ("plain scan", "bf16 grad into f32 carry", "clipped carry",
            "NaN-guarded carry")
# SPEC 11: peak per chip within 1% of the plain scan's; a donated
# oa.update_and_apply micro-step no higher than optax.MultiSteps's (but for
# our state's scalars: 0.1%).
SCAN_TARGET, MULTISTEPS_TARGET = 1.01, 1.001


def _multisteps(loss_fn, k):
  tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=k)

  def micro_step(params, opt_state, microbatch):
    grads = jax.grad(loss_fn)(params, microbatch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return tx, micro_step


def _accumulate(loss_fn, k, axis=None, fused=False):
  """``oa.accumulate``'s micro-step: ``jax.grad``, or with ``axis`` the
  deferred gradient (``gradient_sync="deferred"``); applied with
  ``oa.apply_if_updated``, or with ``fused`` by ``oa.update_and_apply``."""
  tx = oa.accumulate(optax.sgd(0.1), every_k=k, axis_name=axis)
  grad_fn = jax.value_and_grad(loss_fn) if axis is None else (
      oa.value_and_grad(loss_fn, num_microbatches=1, axis_name=axis,
                        num_tokens_fn=tm.num_tokens,
                        gradient_sync="deferred"))

  def micro_step(params, opt_state, microbatch):
    _, grads = grad_fn(params, microbatch)
    n = tm.num_tokens(microbatch)
    if fused:
      return oa.update_and_apply(tx, grads, opt_state, params, num_tokens=n)
    updates, opt_state = tx.update(grads, opt_state, params, num_tokens=n)
    return oa.apply_if_updated(params, updates, opt_state), opt_state

  return tx, micro_step


def _compile(mesh, fn, *args, donate=()):
  """The compiled program, or the compiler's refusal for memory."""
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the fallback leaf.
    try:
      return jax.jit(fn, donate_argnums=donate).lower(*args).compile(), None
    except jax.errors.JaxRuntimeError as e:
      if getattr(e, "error_code_string", None) != "RESOURCE_EXHAUSTED":
        raise
      return None, str(e).splitlines()[0][:300]


def _measure(compiled, mesh, data_axes, k, per_call):
  """Memory and bytes reduced over ``data_axes`` per update.

  ``per_call``: one micro-batch per call, k calls per update (the emitting
  branch once).
  """
  loop = out = branch = 0
  kinds = set()
  for c in co.data_reductions(compiled, mesh, data_axes):
    nbytes = co.reduced_bytes(c, mesh)
    kinds.add(c.collective)
    if c.looped:
      loop += nbytes
    elif c.branched:
      branch += nbytes
    else:
      out += nbytes
  per_update = (k * out + branch) if per_call else (k * loop + out + branch)
  return {**harness.memory(compiled), "loop_bytes": loop, "out_bytes": out,
          "branch_bytes": branch, "per_update_bytes": per_update,
          "kinds": sorted(kinds)}


def _per_call_steps(loss_fn, k, data_axis, mesh, params, micro):
  """The candidates of one micro-batch per call, as ``_mesh_run``'s steps."""
  steps = {}
  for cand, make in ((MULTISTEPS, lambda: _multisteps(loss_fn, k)),
                     (ACCUMULATE, lambda: _accumulate(loss_fn, k)),
                     (FUSED, lambda: _accumulate(loss_fn, k, fused=True)),
                     (DEFERRED, lambda: _accumulate(loss_fn, k, data_axis))):
    tx, micro_step = make()
    with jax.set_mesh(mesh):
      state = jax.eval_shape(tx.init, params)
    steps[cand] = (mesh, micro_step, (params, state, micro), True)
  return steps


class Problem(NamedTuple):
  """The decoder on one mesh of compile-only devices, abstract."""

  cfg: tm.Config
  mesh: Any
  data_axes: tuple[str, ...]
  n_data: int  # devices the batch is split over.
  shapes: Any  # the parameters' shapes, unsharded.
  params: Any  # sharded by tm.specs.
  data: Any  # the batch's shapes, unsharded.
  batch: Any  # sharded over the data axes.


def problem(mesh_spec, cfg_run, devices) -> Problem:
  """``mesh_spec`` (a value of :data:`MESHES`) over ``devices``, with the
  decoder of ``cfg_run["model"]`` and a batch of ``cfg_run["batch"]``."""
  shape, names, model_axes = mesh_spec
  cfg = tm.Config(**cfg_run["model"], **model_axes)
  data_axes = cfg.batch_axes
  mesh = co.mesh(devices, shape, names)
  shapes = jax.eval_shape(lambda: tm.init(cfg))
  data = jax.eval_shape(lambda: tm.batch(cfg, cfg_run["batch"]))
  return Problem(
      cfg, mesh, data_axes,
      math.prod(dict(zip(names, shape))[a] for a in data_axes), shapes,
      co.abstract(shapes, mesh, tm.specs(cfg)), data,
      co.abstract(data, mesh, jax.tree.map(lambda _: P(data_axes), data)))


def _mesh_run(name, cfg_run, devices):
  shape, names, _ = MESHES[name]
  k, rows = cfg_run["k"], cfg_run["batch"]
  cfg, mesh, data_axes, n_data, shapes, params, data, batch = problem(
      MESHES[name], cfg_run, devices)
  micro = co.abstract(jax.eval_shape(lambda: tm.batch(cfg, rows // k)), mesh,
                      jax.tree.map(lambda _: P(data_axes), data))
  loss_fn = tm.loss_fn(cfg)
  steps = {
      FULL: (mesh, jax.value_and_grad(loss_fn), (params, batch), False),
      TYPED: (mesh, oa.value_and_grad(loss_fn, num_microbatches=k,
                                      num_tokens_fn=tm.num_tokens),
              (params, batch), False),
      SCAN: (mesh, peers.token_weighted_scan(loss_fn, k, data_axes, n_data),
             (params, batch), False),
  }
  auto = co.mesh(devices, shape, names, AxisType.Auto)
  auto_params = co.abstract(shapes, auto, tm.specs(cfg))
  auto_batch = co.abstract(data, auto,
                           jax.tree.map(lambda _: P(data_axes), data))
  steps[SHARD_MAP] = (auto, oa.value_and_grad(
      tm.loss_fn(cfg._replace(batch_axes=())), num_microbatches=k,
      num_tokens_fn=tm.num_tokens, axis_name=data_axes[0],
      param_specs=tm.specs(cfg)), (auto_params, auto_batch), False)
  steps.update(_per_call_steps(loss_fn, k, data_axes[0], mesh, params,
                               micro))
  out = {"mesh": dict(zip(names, shape)), "data_axes": list(data_axes),
         "param_bytes": harness.tree_bytes(shapes),
         "params": int(sum(x.size for x in jax.tree.leaves(shapes))),
         "fallback_bytes": cfg.seq * cfg.dim * 4, "candidates": {},
         "refused": {}}
  for cand in cfg_run.get("candidates", CANDIDATES):
    m, fn, args, per_call = steps[cand]
    # Per-call steps donate their parameters and state, as real ones do.
    compiled, refused = _compile(m, fn, *args,
                                 donate=(0, 1) if per_call else ())
    print(f"k. {name}, {cand}: compiled", file=sys.stderr, flush=True)
    if refused:
      out["refused"][cand] = refused
    else:
      out["candidates"][cand] = _measure(compiled, m, data_axes, k, per_call)
  if cfg_run["patterns"] and name == "data x tensor":
    out["patterns"] = {}
    for pattern in PATTERNS:
      compiled, refused = _compile(
          mesh, peers.token_weighted_scan(loss_fn, k, data_axes, n_data,
                                          pattern), params, batch)
      out["patterns"][pattern] = (
          {"refused": refused} if refused
          else _measure(compiled, mesh, data_axes, k, False))
  return out


def _in_process(cfg):
  gpu = cfg.get("compiler", "tpu") == "gpu"
  missing = co.missing_gpu() if gpu else co.missing_tpu()
  if missing:
    return {"skipped": missing, "compiled": 0}
  if gpu:  # 8 compile-only H100s, XLA's GPU compiler (zoo/compile_only).
    topology, devices = "8 x H100 SXM", co.gpu_devices()
  else:
    topology = cfg.get("topology", TOPOLOGY)  # "v5p:2x2x2" has 8 chips too.
    devices = co.tpu_devices(topology)
  return {"k": cfg["k"], "batch": cfg["batch"], "model": cfg["model"],
          "topology": topology, "device_kind": devices[0].device_kind,
          "jax": jax.__version__,
          "meshes": {name: _mesh_run(name, cfg, devices)
                     for name in cfg.get("meshes", MESHES)}}


def run(cfg):
  gpu = cfg.get("compiler", "tpu") == "gpu"
  missing = co.missing_gpu() if gpu else co.missing_tpu()
  if missing:
    return {"skipped": missing, "compiled": 0}
  # libtpu in a fresh process: this one may hold it already (pytest); the
  # CUDA plugin's compile-only GPUs only in one that starts on the CPU.
  env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  if gpu:
    env["JAX_PLATFORMS"] = "cpu"
  return harness.in_child(__file__, cfg, env=env)


def _ratio(group, cand, peer, what="peak_bytes"):
  """``cand``'s figure over ``peer``'s, or None where either is missing."""
  ours = group.get(cand, {}).get(what)
  theirs = group.get(peer, {}).get(what)
  if ours is None or not theirs:
    return None
  return ours / theirs


def _times(ratio):
  return "n/a" if ratio is None else f"{ratio:.3f}x"


def checks(result):
  if "skipped" in result:
    return [harness.Check("k. skipped (no libtpu): nothing to check", 0, 0)]
  out = []
  for name, m in result["meshes"].items():
    c = m["candidates"]
    # The plain scan is not allowed to beat k reductions by mistake in
    # our reading: each per-call candidate reduces at least once per call.
    for cand in (MULTISTEPS,):
      if cand in c and TYPED in c:
        out.append(harness.Check(
            f"k. {name}: typed bytes per update / {cand}'s",
            c[TYPED]["per_update_bytes"] / max(c[cand]["per_update_bytes"],
                                               1), 1.0))
  return out or [harness.Check("k. compiled", 0, 0)]


def summary_rows(result):
  if "skipped" in result:
    return [report.Row("k. TPU v5e compile-only", "skipped", "-", "-", "-",
                       True)]
  rows = []
  for name, m in result["meshes"].items():
    c = m["candidates"]
    for cand, peer, target in ((TYPED, SCAN, SCAN_TARGET),
                               (TYPED, FULL, None),
                               (ACCUMULATE, MULTISTEPS, None),
                               (FUSED, MULTISTEPS, MULTISTEPS_TARGET),
                               (DEFERRED, MULTISTEPS, None)):
      r = _ratio(c, cand, peer)
      if r is None:
        continue
      rows.append(report.Row(
          f"k. {_label(result)} {name}: peak memory per chip, {cand} /"
          f" {peer}",
          _peak(c[cand]), _peak(c[peer]), f"{r:.3f}x",
          "-" if target is None else f"<= {target}x",
          target is None or r <= target))
  return rows


def _label(result):
  return "H100" if "H100" in result.get("device_kind", "") else "TPU v5e"


def _size(nbytes):
  return "-" if nbytes is None else report.mib(nbytes)


def _peak(c):
  return harness.peak_label(c, _size)


def _candidate_lines(m):
  c = m["candidates"]
  lines = [
      "| | peak / chip | vs the hand-written scan | vs optax.MultiSteps |"
      " temp / chip | arguments / chip | bytes per update | in loop (x k) |"
      " outside | in branch | by |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for cand in CANDIDATES:
    if cand not in c and cand not in m["refused"]:
      continue  # not compiled in this run.
    if cand in m["refused"]:
      lines.append(f"| {cand} | refused: {m['refused'][cand]} |"
                   + " |" * 9)
      continue
    x = c[cand]
    lines.append(
        f"| {cand} | {_peak(x)} | {_times(_ratio(c, cand, SCAN))} |"
        f" {_times(_ratio(c, cand, MULTISTEPS))} | {_size(x['temp_bytes'])} |"
        f" {_size(x['argument_bytes'])} | {_size(x['per_update_bytes'])} |"
        f" {_size(x['loop_bytes'])} | {_size(x['out_bytes'])} |"
        f" {_size(x['branch_bytes'])} | {', '.join(x['kinds']) or '-'} |")
  return lines + [""]


def _pattern_lines(patterns):
  lines = ["Loop patterns (a token-weighted scan of `jax.grad`): what"
           " XLA's TPU compiler leaves in the loop.", "",
           "| carry | peak / chip | vs the plain scan | temp / chip |"
           " in loop (x k) | outside |",
           "|---|---|---|---|---|---|"]
  for pattern, c in patterns.items():
    if "refused" in c:
      lines.append(f"| {pattern} | refused: {c['refused']} | | | | |")
      continue
    lines.append(
        f"| {pattern} | {_peak(c)} |"
        f" {_times(_ratio(patterns, pattern, PATTERNS[0]))} |"
        f" {_size(c['temp_bytes'])} | {_size(c['loop_bytes'])} |"
        f" {_size(c['out_bytes'])} |")
  return lines + [""]


def markdown(result):
  if "skipped" in result:
    return [f"Skipped: {result['skipped']}", ""]
  k = result["k"]
  lines = [
      f"Compiled on this machine (no TPU, no GPU) for 8 compile-only"
      f" devices, `{result['topology']}` ({result['device_kind']}, jax"
      f" {result['jax']}), nothing run; the decoder of `zoo/typed_model.py`"
      f" `{report.spec(result['model'])}`, a batch of {result['batch']}"
      f" sequences, k={k}; {', '.join(PER_CALL)} are one micro-batch per"
      " call (parameters and state donated), the others the whole update in"
      " one call. Bytes: the gradient that reductions over the data axes sum"
      f" per update (in the loop x {k}, per-call steps x {k} calls, the"
      " emitting branch once).",
      "",
      harness.MEMORY_NOTE,
      "",
  ]
  for name, m in result["meshes"].items():
    lines += [
        f"### {name} ({m['params'] / 1e9:.2f}B parameters,"
        f" {_size(m['param_bytes'])})", ""]
    lines += _candidate_lines(m)
    if "patterns" in m:
      lines += _pattern_lines(m["patterns"])
  return lines


if __name__ == "__main__":
  config = json.loads(sys.argv[1])
  if config.get("compiler") == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  print(json.dumps(_in_process(config), default=str))
