"""n. ZeRO-1 and ZeRO-2 vs plain data parallelism and FSDP.

Two parts, on the cookbook-style decoder of ``zoo/typed_model.py``, adamw,
one update of ``k`` micro-batches in one ``oa.value_and_grad`` call, the
batch over all 8 devices of a ``data`` mesh (Explicit axes):

**Compiled for TPU v5e** (the 8 compile-only chips of a ``2x4`` slice, needs
libtpu; skipped without it and at toy size), nothing run. Five layouts:

* ``data parallel``: parameters and adamw's state replicated;
* ``ZeRO-1``: parameters replicated, ``param_specs=oa.zero_specs(params,
  "data")``, adamw's state in those shards, ``gradient_sync="once"``: one
  reduce-scatter of the gradient into the shards after the loop, the updates
  all-gathered back;
* ``ZeRO-2``: the same with ``gradient_sync="every_microbatch"`` (the
  running sum sharded, ``k`` reduce-scatters per update);
* ``FSDP once`` / ``FSDP every micro-batch``: parameters sharded over
  ``data`` (``tm.Config(fsdp="data")``), adamw's state like them.

Per chip: ``memory_analysis().peak_memory_in_bytes`` (read by
``harness.memory``, which is ``memory_analysis.device_memory``), the
argument bytes, adamw's state bytes (from the shardings of its leaves) and
the **bytes on the wire per update**. Those are counted from the compiled
program's collectives (``optax_accum._src.compiled.hlo.collectives``, scalars
left out) as a ring algorithm sends them, per device, with ``n`` the devices
of the collective's mesh axes and ``b`` the bytes of its result:

* all-reduce: ``2 (n - 1) / n * b`` (a reduce-scatter and an all-gather);
* reduce-scatter: ``(n - 1) / n * (n * b)`` (its whole operand is ``n * b``);
* all-gather: ``(n - 1) / n * b`` (its result is whole);
* all-to-all: ``(n - 1) / n * b``; collective-permute: ``b``;

times ``k`` for a collective inside the micro-batch loop. This is what each
device sends (and receives); the time it takes depends on the links (ICI on
a v5e slice), which compile-only devices cannot tell.

**CPU timing** (8 simulated CPU devices; in a child process when jax has
fewer): one update for data parallel, ZeRO-1 and ZeRO-2, interleaved
repetitions, medians; and the parameters after one update of ZeRO-1 and
ZeRO-2 against data parallelism's (max abs difference <= 1e-5 for ZeRO-1,
the same sums sharded; <= 1e-3, a tenth of the learning rate, for ZeRO-2,
whose per-micro-batch reductions sum in another order, roundoff that adamw's
normalisation magnifies). The CPU's 8 devices share 2 cores and memory, so the
time tells the cost of the extra collectives and resharding on one host, not
an accelerator's.
"""

import json
import math
import sys
import warnings

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import harness
import optax_accum as oa
from optax_accum._src.compiled import hlo
import report
from zoo import compile_only as co
from zoo import typed_model as tm

KEY = "n"
TITLE = "ZeRO-1 / ZeRO-2 vs data parallelism and FSDP (TPU v5e compiled, CPU)"
TOPOLOGY = "v5e:2x4"
DEVICES = 8
_TOY_MODEL = {"vocab": 64, "seq": 8, "dim": 32, "heads": 4, "ffn": 64,
              "layers": 1}
CONFIGS = {
    "full": {
        "tpu": True, "k": 8, "batch": 64, "model": {
            "vocab": 32768, "seq": 1024, "dim": 4096, "heads": 32,
            "ffn": 16384, "layers": 4},
        "cpu_k": 4, "cpu_batch": 64, "reps": 10, "cpu_model": {
            "vocab": 2048, "seq": 64, "dim": 256, "heads": 4, "ffn": 1024,
            "layers": 2}},
    "quick": {
        "tpu": True, "k": 8, "batch": 64, "model": {
            "vocab": 32768, "seq": 1024, "dim": 2048, "heads": 16,
            "ffn": 8192, "layers": 2},
        "cpu_k": 4, "cpu_batch": 32, "reps": 5, "cpu_model": {
            "vocab": 512, "seq": 32, "dim": 128, "heads": 4, "ffn": 512,
            "layers": 2}},
    "toy": {
        "tpu": False, "k": 2, "batch": 16, "model": _TOY_MODEL,
        "cpu_k": 2, "cpu_batch": 16, "reps": 1, "cpu_model": _TOY_MODEL},
}
DP, ZERO1, ZERO2 = "data parallel", "ZeRO-1", "ZeRO-2"
FSDP1, FSDP2 = "FSDP once", "FSDP every micro-batch"
LAYOUTS = (DP, ZERO1, ZERO2, FSDP1, FSDP2)
CPU_LAYOUTS = (DP, ZERO1, ZERO2)
SYNC = {DP: "once", ZERO1: "once", ZERO2: "every_microbatch", FSDP1: "once",
        FSDP2: "every_microbatch"}
# ZeRO's parameters after one update vs data parallelism's: ZeRO-1 sums the
# same gradient once (1e-7 measured). ZeRO-2 reduces each micro-batch's
# gradient on its own, a different order of float32 sums, and adamw's
# normalisation (m / sqrt(v)) magnifies that roundoff where v is tiny:
# 6.8e-5 measured at the quick size, learning rate 1e-2; a tenth of it.
EXACT_TOLERANCE = {"ZeRO-1": 1e-5, "ZeRO-2": 1e-3}
# ZeRO-1's adamw state per chip vs data parallelism's (1/8 on 8 chips, up to
# the leaves zero_specs keeps whole).
STATE_TARGET = 0.25


def wire_bytes(c, mesh, k):
  """Bytes one device sends for collective ``c`` per update (a ring)."""
  n = math.prod(mesh.shape[a] for a in (c.axes or ()))
  if n <= 1:
    return 0.0
  b = c.nbytes
  sent = {"all-reduce": 2 * (n - 1) / n * b,
          "reduce-scatter": (n - 1) / n * (n * b),
          "all-gather": (n - 1) / n * b,
          "all-to-all": (n - 1) / n * b,
          "collective-permute": b}.get(c.collective, b)
  return sent * (k if c.looped else 1)


def _wire(compiled, mesh, k):
  total, by_kind = 0.0, {}
  for c in hlo.collectives(compiled, mesh):
    if c.scalar:
      continue
    sent = wire_bytes(c, mesh, k)
    total += sent
    name = c.collective + (" (in loop)" if c.looped else "")
    by_kind[name] = by_kind.get(name, 0.0) + sent
  return total, by_kind


def _shard_bytes(tree):
  """Bytes per device of abstract leaves with shardings."""
  return int(sum(math.prod(x.shape if x.sharding is None
                           else x.sharding.shard_shape(x.shape))
                 * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _layout(mesh, model, layout):
  """The config, the parameters' specs and the optimizer's specs."""
  cfg = tm.Config(**model, batch_axes=("data",), pos_broadcast=True,
                  fsdp="data" if layout in (FSDP1, FSDP2) else None)
  own = tm.specs(cfg)
  if layout in (ZERO1, ZERO2):
    shapes = jax.eval_shape(lambda: tm.init(cfg))
    with jax.set_mesh(mesh):
      specs = oa.zero_specs(co.abstract(shapes, mesh, own), "data")
  else:
    specs = own
  return cfg, own, specs


def _step(cfg, specs, k, layout, opt):
  zero = layout in (ZERO1, ZERO2)
  grad_fn = oa.value_and_grad(
      tm.loss_fn(cfg), num_microbatches=k, num_tokens_fn=tm.num_tokens,
      param_specs=specs if zero else None, gradient_sync=SYNC[layout])
  return co.zero_step(grad_fn, opt, specs)


def _compile(mesh, fn, *args):
  """The compiled program, or the compiler's refusal for memory."""
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # a fallback leaf.
    try:
      return jax.jit(fn).lower(*args).compile(), None
    except jax.errors.JaxRuntimeError as e:
      if getattr(e, "error_code_string", None) != "RESOURCE_EXHAUSTED":
        raise
      return None, str(e).splitlines()[0][:300]


def _tpu(cfg_run):
  devices = co.tpu_devices(TOPOLOGY)
  mesh = co.mesh(devices, (DEVICES,), ("data",))
  k, opt = cfg_run["k"], optax.adamw(1e-3)
  out = {"topology": TOPOLOGY, "device_kind": devices[0].device_kind,
         "jax": jax.__version__, "k": k, "batch": cfg_run["batch"],
         "model": cfg_run["model"], "layouts": {}, "refused": {}}
  for layout in cfg_run.get("layouts", LAYOUTS):
    cfg, own, specs = _layout(mesh, cfg_run["model"], layout)
    shapes = jax.eval_shape(lambda cfg=cfg: tm.init(cfg))
    params = co.abstract(shapes, mesh, own)
    data = jax.eval_shape(lambda cfg=cfg: tm.batch(cfg, cfg_run["batch"]))
    batch = co.abstract(data, mesh, jax.tree.map(lambda _: P("data"), data))
    with jax.set_mesh(mesh):
      opt_state = jax.eval_shape(opt.init, co.abstract(shapes, mesh, specs))
    out["params"] = int(sum(x.size for x in jax.tree.leaves(shapes)))
    out["param_bytes"] = harness.tree_bytes(shapes)
    entry = {"state_bytes": _shard_bytes(opt_state),
             "param_bytes_per_chip": _shard_bytes(params),
             "sync": SYNC[layout]}
    compiled, refused = _compile(mesh, _step(cfg, specs, k, layout, opt),
                                 params, opt_state, batch)
    print(f"n. TPU {layout}: compiled", file=sys.stderr, flush=True)
    if refused:
      out["refused"][layout] = refused
      entry["refused"] = refused
    else:
      wire, by_kind = _wire(compiled, mesh, k)
      entry.update(harness.memory(compiled), wire_bytes=wire,
                   wire_by_kind=by_kind)
    out["layouts"][layout] = entry
  return out


def _cpu(cfg_run):
  mesh = jax.make_mesh((DEVICES,), ("data",),
                       axis_types=(AxisType.Explicit,))
  k, opt = cfg_run["cpu_k"], optax.adamw(1e-2)
  out = {"k": k, "batch": cfg_run["cpu_batch"], "model": cfg_run["cpu_model"],
         "devices": DEVICES, "memory": {}, "wire_bytes": {}, "diff": {}}
  updates = {}
  for layout in CPU_LAYOUTS:
    cfg, own, specs = _layout(mesh, cfg_run["cpu_model"], layout)
    with jax.set_mesh(mesh):
      params = jax.device_put(tm.init(cfg), jax.tree.map(
          lambda s: NamedSharding(mesh, s), own))
      batch = jax.device_put(tm.batch(cfg, cfg_run["cpu_batch"]),
                             NamedSharding(mesh, P("data")))
      opt_state = jax.jit(opt.init)(jax.sharding.reshard(params, specs))
    compiled, _ = _compile(mesh, _step(cfg, specs, k, layout, opt), params,
                           opt_state, batch)
    out["memory"][layout] = harness.memory(compiled)
    out["wire_bytes"][layout] = _wire(compiled, mesh, k)[0]
    updates[layout] = (lambda c=compiled, a=(params, opt_state, batch):
                       jax.block_until_ready(c(*a)))
  out["param_bytes"] = harness.tree_bytes(params)
  results, times = harness.time_updates(updates, cfg_run["reps"])
  out["times"] = harness.summarize_times(times)
  for layout in (ZERO1, ZERO2):
    out["diff"][layout] = float(max(
        np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in zip(
            jax.tree.leaves(results[layout][0]),
            jax.tree.leaves(results[DP][0]))))
  return out


def _in_process(cfg):
  part = cfg["part"]
  if part == "tpu":
    return _tpu(cfg)
  return _cpu(cfg)


def run(cfg):
  out = {}
  if jax.device_count() >= DEVICES:
    out["cpu"] = _cpu(cfg)
  else:
    out["cpu"] = harness.in_child(__file__, {**cfg, "part": "cpu"})
  missing = co.missing_tpu()
  if not cfg["tpu"]:
    out["tpu"] = {"skipped": "not at this size (toy): CPU only"}
  elif missing:
    out["tpu"] = {"skipped": missing}
  else:
    # libtpu in a fresh process: this one may hold it already (pytest).
    out["tpu"] = harness.in_child(__file__, {**cfg, "part": "tpu"},
                                  env={"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
  return out


def checks(result):
  cpu = result["cpu"]
  out = [harness.Check(
      f"n. CPU: max abs parameter diff after one update, {layout} vs data"
      " parallel", cpu["diff"][layout], EXACT_TOLERANCE[layout])
         for layout in (ZERO1, ZERO2)]
  tpu = result["tpu"]
  if "skipped" not in tpu:
    lay = tpu["layouts"]
    out.append(harness.Check(
        "n. TPU v5e: ZeRO-1's adamw state per chip / data parallel's",
        lay[ZERO1]["state_bytes"] / lay[DP]["state_bytes"], STATE_TARGET))
  return out


def _size(nbytes):
  return "-" if nbytes is None else report.mib(nbytes)


def summary_rows(result):
  cpu = result["cpu"]
  t = cpu["times"]
  rows = []
  for layout in (ZERO1, ZERO2):
    r = t[layout]["median_s"] / t[DP]["median_s"]
    rows.append(report.Row(
        f"n. CPU (8 devices): one update, {layout} / data parallel",
        report.ms(t[layout]["median_s"]), report.ms(t[DP]["median_s"]),
        f"{r:.3f}x", "-", True))
  tpu = result["tpu"]
  if "skipped" in tpu:
    rows.append(report.Row("n. TPU v5e compile-only", "skipped", "-", "-",
                           "-", True))
    return rows
  lay = tpu["layouts"]
  r = lay[ZERO1]["state_bytes"] / lay[DP]["state_bytes"]
  rows.append(report.Row(
      "n. TPU v5e: adamw state per chip, ZeRO-1 / data parallel",
      _size(lay[ZERO1]["state_bytes"]), _size(lay[DP]["state_bytes"]),
      f"{r:.3f}x", f"<= {STATE_TARGET}x", r <= STATE_TARGET))
  if "peak_bytes" in lay[ZERO1] and "peak_bytes" in lay[DP]:
    r = lay[ZERO1]["peak_bytes"] / lay[DP]["peak_bytes"]
    rows.append(report.Row(
        "n. TPU v5e: peak per chip, ZeRO-1 / data parallel",
        _size(lay[ZERO1]["peak_bytes"]), _size(lay[DP]["peak_bytes"]),
        f"{r:.3f}x", "-", True))
  return rows


def _tpu_lines(tpu):
  if "skipped" in tpu:
    return [f"TPU v5e part skipped: {tpu['skipped']}", ""]
  lines = [
      f"Compiled on this machine (no TPU) for the 8 compile-only chips of a"
      f" `{tpu['topology']}` slice ({tpu['device_kind']}, jax {tpu['jax']}),"
      " nothing run; the decoder of `zoo/typed_model.py`"
      f" `{report.spec(tpu['model'])}` ({tpu['params'] / 1e9:.2f}B"
      f" parameters, {_size(tpu['param_bytes'])} of float32), adamw, a batch"
      f" of {tpu['batch']} sequences over the 8 chips, k={tpu['k']}. Bytes"
      " on the wire: what each chip sends per update (ring algorithm; see"
      " the module's docstring).", "",
      "| layout | gradient_sync | peak / chip | arguments / chip |"
      " parameters / chip | adamw state / chip | on the wire / chip / update"
      " | by |",
      "|---|---|---|---|---|---|---|---|"]
  for layout, x in tpu["layouts"].items():
    if "refused" in x:
      lines.append(
          f"| {layout} | {x['sync']} | refused: {x['refused']} | |"
          f" {_size(x['param_bytes_per_chip'])} |"
          f" {_size(x['state_bytes'])} | | |")
      continue
    by = ", ".join(f"{name} {_size(b)}"
                   for name, b in sorted(x["wire_by_kind"].items()))
    lines.append(
        f"| {layout} | {x['sync']} | {harness.peak_label(x, _size)} |"
        f" {_size(x['argument_bytes'])} |"
        f" {_size(x['param_bytes_per_chip'])} | {_size(x['state_bytes'])} |"
        f" {_size(x['wire_bytes'])} | {by} |")
  return lines + [""]


def _cpu_lines(cpu):
  t = cpu["times"]
  lines = [
      f"CPU: {cpu['devices']} simulated devices, the decoder"
      f" `{report.spec(cpu['model'])}` ({_size(cpu['param_bytes'])}), a"
      f" batch of {cpu['batch']}, k={cpu['k']}, one update in one call"
      f" (`oa.value_and_grad` + adamw); {t[DP]['reps']} interleaved"
      " repetitions, medians.", "",
      "| layout | wall | CPU | vs data parallel | peak |"
      " on the wire / device / update | params diff vs data parallel |",
      "|---|---|---|---|---|---|---|"]
  for layout in CPU_LAYOUTS:
    x = t[layout]
    diff = cpu["diff"].get(layout)
    lines.append(
        f"| {layout} | {report.ms(x['median_s'])} |"
        f" {report.ms(x['cpu_median_s'])} |"
        f" {x['median_s'] / t[DP]['median_s']:.3f}x |"
        f" {harness.peak_label(cpu['memory'][layout], _size)} |"
        f" {_size(cpu['wire_bytes'][layout])} |"
        f" {'-' if diff is None else f'{diff:.1e}'} |")
  return lines + [""]


def markdown(result):
  return (_tpu_lines(result["tpu"]) + _cpu_lines(result["cpu"])
          + [harness.MEMORY_REF, ""])


if __name__ == "__main__":
  _cfg = json.loads(sys.argv[1])
  if _cfg["part"] == "cpu":
    jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(_in_process(_cfg), default=str))
