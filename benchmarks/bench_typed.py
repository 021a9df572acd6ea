"""j. The typed form on a cookbook-style decoder, 8 simulated devices.

``zoo/typed_model.py``, a decoder written for :func:`jax.jit` (annotations
that name the batch axes, FSDP and tensor-parallel weights, an elementwise
positional add that JAX cannot type ``reduced``), on two meshes of 8 CPU
devices: ``data x tensor`` (4 x 2: the batch over ``data``, the weights
tensor-parallel) and ``fsdp`` (8: the batch and the weights over ``fsdp``).
On each, one gradient of the whole batch over ``k`` micro-batches, four ways,
against the full batch ``jax.jit(jax.value_and_grad(loss_fn))`` on the same
mesh:

* ``typed``: ``oa.value_and_grad(loss_fn, num_microbatches=k,
  num_tokens_fn=...)`` under jit: parameters typed ``reduced``, unreduced
  gradient sums, one reduction after the loop (the fallback leaf aside);
* ``naive scan``: a ``lax.scan`` of ``jax.grad`` over the micro-batches
  (token-weighted, so exact): JAX reduces every micro-batch's gradient;
* ``shard_map``: the previous release's way, the data axes made Manual in a
  :func:`jax.shard_map` around ``loss_fn``. The model's annotations name the
  data axes, which fails under Manual axes, so this row runs the model
  without activation annotations (``Config(batch_axes=())``) on a mesh of
  the same shape with Auto axes and ``axis_name=`` the data axis: the path
  optax_accum still takes for Auto axes. If it cannot run, the row records
  the error.

Per candidate: time (interleaved repetitions, medians), compiled peak and
temporary memory (``harness.memory``; XLA:CPU's peak counts no temporaries,
so the peak here is temp + arguments + outputs - aliased, flagged) and the
bytes of the gradients that reductions over the data axes sum
(all-reduces and reduce-scatters of 64 bytes or more) per update: inside the
loop times ``k``, plus outside it; with and without the fallback leaf
(``params['pos']``, reduced in every micro-batch by the typed form). Checked:
each gradient against the full batch's; the typed form's bytes, fallback
aside, against the full batch's; the naive scan's against ``k`` times them.
On the ``fsdp`` mesh the loop holds the whole gathered parameters and a whole
(unreduced) gradient sum on every device, two parameter-sized buffers that
the full batch holds as well; they bound how far temporary memory falls.
This process needs 8 devices: with fewer, ``run`` starts itself in a child
process with ``jax_num_cpu_devices=8``.
"""

import json
import math
import sys
from typing import NamedTuple
import warnings

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import harness
import optax_accum as oa
from optax_accum._src.compiled import hlo
import report
from zoo import peers
from zoo import typed_model as tm

KEY = "j"
TITLE = "The typed form: a cookbook-style decoder on 8 devices"
DEVICES = 8
CONFIGS = {
    "full": {"k": 8, "reps": 5, "batch": 64, "model": {
        "vocab": 256, "seq": 64, "dim": 256, "heads": 4, "ffn": 1024,
        "layers": 4}},
    "quick": {"k": 8, "reps": 3, "batch": 64, "model": {
        "vocab": 128, "seq": 32, "dim": 128, "heads": 4, "ffn": 512,
        "layers": 2}},
    "toy": {"k": 2, "reps": 1, "batch": 32, "model": {
        "vocab": 32, "seq": 8, "dim": 16, "heads": 4, "ffn": 32,
        "layers": 2}},
}
# name -> (mesh shape, axis names, the model's axes: batch_axes are the data
# axes).
MESHES = {
    "data x tensor": ((4, 2), ("data", "tensor"),
                      {"batch_axes": ("data",), "tensor": "tensor"}),
    "fsdp": ((8,), ("fsdp",), {"batch_axes": ("fsdp",), "fsdp": "fsdp"}),
}
FULL, TYPED, NAIVE = "full batch", "typed", "naive scan"
SHARD_MAP = "shard_map"
FALLBACK_LEAF = "params['pos']"
# The goals for the typed form, as ratios to the full batch: bytes
# reduced over the data axes (the fallback leaf aside), time, temp memory
# (the activations, which fall with k). SPEC 11: its peak within 1% of the
# naive scan's.
BYTES_TARGET, TIME_TARGET, MEMORY_TARGET = 1.05, 1.05, 0.5
SCAN_TARGET = 1.01
# Gradients agree with the full batch's to this, relative to their largest.
# Float32 sums in another order differ by about 1e-5 at full size (the full
# batch on the mesh and on one device do); a wrong weighting, or a
# micro-batch missed, by 1e-2 or more.
GRAD_TOLERANCE = 3e-5
# A reduction of fewer bytes is a scalar (a loss, a token count).
MIN_GRADIENT_BYTES = 64


def _reduction_bytes(compiled, mesh, data_axes):
  """Bytes of gradient-sized reductions over ``data_axes``: loop and out.

  The bytes a reduction sums: an all-reduce's result, a reduce-scatter's
  result times its group's size (its result is one device's part), so that
  both count the gradient they reduce. ``kinds``: which of the two ran.
  """
  sizes = dict(mesh.shape)
  out, kinds = {"loop": 0, "out": 0}, set()
  for c in hlo.collectives(compiled, mesh):
    if (c.collective in ("all-reduce", "reduce-scatter")
        and set(c.axes) & set(data_axes) and c.nbytes >= MIN_GRADIENT_BYTES):
      group = math.prod(sizes[a] for a in c.axes)
      scattered = c.collective == "reduce-scatter"
      out["loop" if c.looped else "out"] += c.nbytes * (
          group if scattered else 1)
      kinds.add(c.collective)
  return dict(out, kinds=sorted(kinds))


def _per_update(nbytes, k, fallback_bytes):
  """Bytes per update, with and without the fallback leaf.

  The fallback leaf is reduced in every micro-batch where the loop reduces
  anything (the typed form, the naive scan), else once, after it.
  """
  total = k * nbytes["loop"] + nbytes["out"]
  times = k if nbytes["loop"] >= fallback_bytes else 1
  return {"loop": nbytes["loop"], "out": nbytes["out"], "total": total,
          "without_fallback": total - times * fallback_bytes,
          "kinds": nbytes["kinds"]}


def _placed(mesh, cfg, params, batch):
  specs = tm.specs(cfg)
  return (jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                       params, specs),
          jax.device_put(batch, NamedSharding(mesh, P(cfg.batch_axes))))


def _shard_map_form(shape, names, cfg, k, params, batch, annotated=False):
  """The previous release's path: Auto axes, a shard_map around loss_fn.

  Without ``annotated``, the model's activations carry no annotations (the
  ones it has name the data axes, Manual inside the shard_map).
  """
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  model = cfg if annotated else cfg._replace(batch_axes=())
  with jax.set_mesh(mesh):
    p, b = _placed(mesh, cfg, params, batch)
    fn = jax.jit(oa.value_and_grad(
        tm.loss_fn(model), num_microbatches=k, num_tokens_fn=tm.num_tokens,
        axis_name=cfg.batch_axes[0], param_specs=tm.specs(cfg)))
    return mesh, fn.lower(p, b).compile(), (p, b)


def _error(e):
  """The exception's type and first sentence."""
  first = str(e).splitlines()[0].split(". ")[0].rstrip(".")
  return f"{type(e).__name__}: {first[:400]}."


def _annotated_error(shape, names, cfg, k, params, batch):
  """Why the shard_map form refuses the model as written, or None."""
  try:
    _shard_map_form(shape, names, cfg, k, params, batch, annotated=True)
  except Exception as e:  # pylint: disable=broad-except
    return _error(e)
  return None


class Candidates(NamedTuple):
  """The compiled programs of one mesh, their arguments and their meshes."""
  compiled: dict  # name -> compiled program.
  args: dict  # name -> (params, batch), placed on its mesh.
  meshes: dict  # name -> the mesh it runs on.
  errors: dict  # name -> why it did not compile (the shard_map form).
  fallback: tuple  # the typed form's fallback leaves.


def _candidates(name, k, cfg, params, batch):
  """Compiles the full batch, the typed form, the naive scan, shard_map."""
  shape, names, _ = MESHES[name]
  mesh = jax.make_mesh(shape, names,
                       axis_types=(AxisType.Explicit,) * len(names))
  devices = math.prod(dict(zip(names, shape))[a] for a in cfg.batch_axes)
  out = Candidates({}, {}, {}, {}, ())
  with jax.set_mesh(mesh):
    placed = _placed(mesh, cfg, params, batch)
    loss_fn = tm.loss_fn(cfg)
    typed = jax.jit(oa.value_and_grad(
        loss_fn, num_microbatches=k, num_tokens_fn=tm.num_tokens))
    out = out._replace(
        fallback=oa.sharding_report(typed, *placed).fallback_leaves)
    steps = {FULL: jax.jit(jax.value_and_grad(loss_fn)), TYPED: typed,
             NAIVE: jax.jit(peers.token_weighted_scan(
                 loss_fn, k, cfg.batch_axes, devices))}
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)  # the fallback, reported
      for cand, f in steps.items():
        out.compiled[cand] = f.lower(*placed).compile()
        out.args[cand], out.meshes[cand] = placed, mesh
  try:
    out.meshes[SHARD_MAP], out.compiled[SHARD_MAP], out.args[SHARD_MAP] = (
        _shard_map_form(shape, names, cfg, k, params, batch))
  except Exception as e:  # pylint: disable=broad-except
    out.errors[SHARD_MAP] = _error(e)
  return out


def _mesh_run(name, cfg_run):
  """Every candidate's time, memory, bytes and gradient on one mesh."""
  shape, names, model_axes = MESHES[name]
  k = cfg_run["k"]
  cfg = tm.Config(**cfg_run["model"], **model_axes)
  params, batch = tm.init(cfg), tm.batch(cfg, cfg_run["batch"])
  fallback_bytes = params["pos"].size * params["pos"].itemsize
  cands = _candidates(name, k, cfg, params, batch)
  results = {cand: jax.device_get(c(*cands.args[cand]))
             for cand, c in cands.compiled.items()}
  times = harness.interleaved(
      {cand: (lambda c=c, a=cands.args[cand]: jax.block_until_ready(c(*a)))
       for cand, c in cands.compiled.items()}, reps=cfg_run["reps"])
  full_loss, full_grads = results[FULL]
  scale = harness.max_abs(full_grads)
  out = {"mesh": dict(zip(names, shape)), "data_axes": list(cfg.batch_axes),
         "fallback_leaves": list(cands.fallback),
         "fallback_bytes": fallback_bytes,
         "param_bytes": harness.tree_bytes(params),
         "candidates": harness.summarize_times(times),
         "errors": cands.errors,
         "shard_map_with_annotations": _annotated_error(
             shape, names, cfg, k, params, batch) or "runs",
         "memory": {}, "reduction_bytes": {}, "grad_diff": {},
         "loss_diff": {}}
  for cand, c in cands.compiled.items():
    out["memory"][cand] = harness.memory(c)
    out["reduction_bytes"][cand] = _per_update(
        _reduction_bytes(c, cands.meshes[cand], cfg.batch_axes), k,
        fallback_bytes)
    loss, grads = results[cand]
    out["grad_diff"][cand] = harness.max_abs_diff(grads, full_grads) / scale
    out["loss_diff"][cand] = abs(float(loss) - float(full_loss))
  return out


def _in_process(cfg):
  return {"k": cfg["k"], "batch": cfg["batch"], "model": cfg["model"],
          "devices": DEVICES,
          "meshes": {name: _mesh_run(name, cfg) for name in MESHES}}


def run(cfg):
  if jax.device_count() >= DEVICES:
    return _in_process(cfg)
  # jax has started with fewer devices: measure in a fresh process.
  return harness.in_child(__file__, cfg)


def _ratio(m, cand, what, peer=FULL):
  """``cand``'s figure over ``peer``'s: time, memory, peak or bytes."""
  if what == "time":
    return m["candidates"][cand]["median_s"] / m["candidates"][peer][
        "median_s"]
  if what in ("memory", "peak"):
    key = "temp_bytes" if what == "memory" else "peak_bytes"
    ours, full = (m["memory"][c][key] for c in (cand, peer))
  else:
    ours, full = (m["reduction_bytes"][c][what] for c in (cand, peer))
  return ours / max(full, 1)


def checks(result):
  k, out = result["k"], []
  for name, m in result["meshes"].items():
    for cand, diff in m["grad_diff"].items():
      if cand == FULL:
        continue
      out.append(harness.Check(
          f"j. {name}, {cand}: max abs grad diff vs full batch / max abs grad",
          diff, GRAD_TOLERANCE))
    out.append(harness.Check(
        f"j. {name}, typed: bytes reduced over the data axes (fallback"
        " aside) / full batch's",
        _ratio(m, TYPED, "without_fallback"), BYTES_TARGET))
    # The negative control: the naive scan reduces every micro-batch.
    out.append(harness.Check(
        f"j. {name}, naive scan: k / (bytes reduced / full batch's)",
        k / max(_ratio(m, NAIVE, "without_fallback"), 1e-9), 1.05))
  return out


def summary_rows(result):
  k, rows = result["k"], []
  for name, m in result["meshes"].items():
    t = m["candidates"]
    mem, red = m["memory"], m["reduction_bytes"]
    time_r, mem_r = _ratio(m, TYPED, "time"), _ratio(m, TYPED, "memory")
    peak_r = _ratio(m, TYPED, "peak", NAIVE)
    bytes_r = _ratio(m, TYPED, "without_fallback")
    rows += [
        report.Row(f"j. {name}: time, typed / full batch (k={k})",
                   report.ms(t[TYPED]["median_s"]),
                   report.ms(t[FULL]["median_s"]), f"{time_r:.2f}x",
                   f"<= {TIME_TARGET}x", time_r <= TIME_TARGET),
        report.Row(f"j. {name}: temp memory, typed / full batch (k={k})",
                   report.mib(mem[TYPED]["temp_bytes"]),
                   report.mib(mem[FULL]["temp_bytes"]), f"{mem_r:.2f}x",
                   f"<= {MEMORY_TARGET}x", mem_r <= MEMORY_TARGET),
        report.Row(f"j. {name}: peak memory, typed / naive scan (k={k})",
                   harness.peak_label(mem[TYPED], report.mib),
                   harness.peak_label(mem[NAIVE], report.mib),
                   f"{peak_r:.3f}x", f"<= {SCAN_TARGET}x",
                   peak_r <= SCAN_TARGET),
        report.Row(f"j. {name}: bytes reduced over data axes per update,"
                   f" typed / full batch, {FALLBACK_LEAF} aside (k={k})",
                   report.mib(red[TYPED]["without_fallback"]),
                   report.mib(red[FULL]["without_fallback"]),
                   f"{bytes_r:.3f}x", f"<= {BYTES_TARGET}x",
                   bytes_r <= BYTES_TARGET),
        report.Row(f"j. {name}: bytes reduced over data axes per update,"
                   f" typed / full batch, with {FALLBACK_LEAF} (k={k})",
                   report.mib(red[TYPED]["total"]),
                   report.mib(red[FULL]["total"]),
                   f"{_ratio(m, TYPED, 'total'):.3f}x", "-", True),
    ]
    if SHARD_MAP in m["errors"]:
      rows.append(report.Row(
          f"j. {name}: time, shard_map form / full batch (k={k})",
          "fails", report.ms(t[FULL]["median_s"]), "-", "-", True))
    else:
      sm = _ratio(m, SHARD_MAP, "time")
      rows.append(report.Row(
          f"j. {name}: time, shard_map form (Auto axes) / full batch (k={k})",
          report.ms(t[SHARD_MAP]["median_s"]),
          report.ms(t[FULL]["median_s"]), f"{sm:.2f}x", "-", True))
  return rows


def _size(nbytes):
  """MiB, or KiB below one MiB (a fallback leaf's share is small)."""
  if nbytes < harness.MiB:
    return f"{nbytes / 1024:.1f} KiB"
  return report.mib(nbytes)


def _mesh_lines(name, m, k):
  axes = " x ".join(f"{a}={n}" for a, n in m["mesh"].items())
  fallback = ", ".join(m["fallback_leaves"]) or "none"
  lines = [
      f"### {name} ({axes}; data axes {', '.join(m['data_axes'])})",
      "",
      f"Parameters {_size(m['param_bytes'])}; fallback leaves of the typed"
      f" form: {fallback} ({_size(m['fallback_bytes'])}). Bytes are those of"
      " the gradients that reductions over the data axes sum, per update:"
      f" in the loop x {k} + outside. The shard_map form on the model as"
      " written, its annotations naming the data axes:"
      f" {m['shard_map_with_annotations']}",
      "",
      "| | time (p25-p75) | / full | peak memory | vs the hand-written"
      " scan | vs optax.MultiSteps | temp memory | / full | arguments |"
      " bytes per update | / full | fallback aside | / full | by |"
      " grad diff |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for cand in (FULL, TYPED, NAIVE, SHARD_MAP):
    if cand in m["errors"]:
      lines.append(f"| {cand} | fails: {m['errors'][cand]} |" + " |" * 13)
      continue
    t, red = m["candidates"][cand], m["reduction_bytes"][cand]
    lines.append(
        f"| {cand} | {report.ms(t['median_s'])} ({report.ms(t['p25_s'])}-"
        f"{report.ms(t['p75_s'])}) | {_ratio(m, cand, 'time'):.2f}x |"
        f" {harness.peak_label(m['memory'][cand], _size)} |"
        f" {_ratio(m, cand, 'peak', NAIVE):.3f}x | n/a |"
        f" {_size(m['memory'][cand]['temp_bytes'])} |"
        f" {_ratio(m, cand, 'memory'):.2f}x |"
        f" {_size(m['memory'][cand]['argument_bytes'])} |"
        f" {_size(red['total'])} ({_size(red['loop'])} x {k} +"
        f" {_size(red['out'])}) | {_ratio(m, cand, 'total'):.3f}x |"
        f" {_size(red['without_fallback'])} |"
        f" {_ratio(m, cand, 'without_fallback'):.3f}x |"
        f" {', '.join(red['kinds']) or '-'} | {m['grad_diff'][cand]:.1e} |")
  return lines + [""]


def markdown(result):
  k = result["k"]
  lines = [
      f"One gradient of a batch of {result['batch']} sequences over k={k}"
      f" micro-batches on {result['devices']} simulated CPU devices, the"
      f" decoder of `zoo/typed_model.py` `{report.spec(result['model'])}`."
      " Ratios are to the full batch `jax.jit(jax.value_and_grad(loss_fn))`"
      " on the same mesh; `shard_map` is the previous release's form (Auto"
      " axes, the model without activation annotations). Grad diff: max abs"
      " difference to the full batch's gradient / its largest entry. Targets"
      f" for the typed form: bytes <= {BYTES_TARGET}x (fallback aside), time"
      f" <= {TIME_TARGET}x, temp memory <= {MEMORY_TARGET}x (the"
      f" activations), peak <= {SCAN_TARGET}x the naive scan's (the"
      " hand-written scan). No per-call form here: vs optax.MultiSteps is"
      " n/a (benchmark k has it). A"
      " reduce-scatter's bytes count the whole gradient it sums, as an"
      " all-reduce's do; on a ring it moves about half the bytes of an"
      " all-reduce of that gradient (the `by` column says which ran).",
      "",
  ]
  lines += [harness.MEMORY_REF, ""]
  for name, m in result["meshes"].items():
    lines += _mesh_lines(name, m, k)
  return lines


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", DEVICES)
  print(json.dumps(_in_process(json.loads(sys.argv[1]))))
