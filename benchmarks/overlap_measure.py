"""Benchmark q's measurement, in the child process of one compiler setting.

Per candidate: ``oa.reduction_overlap`` (the share of the gradient
reduction's bytes that start asynchronously before the last matrix
multiply, and the flops scheduled between each start and done),
``peak_memory_in_bytes`` per device, the wall time of tracing and lowering
and of compiling, the data-axis reductions counted by
``oa.count_collectives`` and their bytes per update, and what produces each
running sum in the loop (:mod:`loop_sums`).

:func:`in_process` returns the raw figures, each reduction and each running
sum listed; :func:`summary` keeps what the report reads.
"""

import os
import sys

import jax
from jax.sharding import PartitionSpec as P

import bench_compiled
import harness
import loop_sums
import optax_accum as oa
import overlap_candidates as oc


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


def _warm_up(mesh):
  """One small compile first: the compiler's start-up is no candidate's."""
  x = jax.ShapeDtypeStruct((8, 128), jax.numpy.float32,
                           sharding=jax.NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile()


def _read(compiled, mesh, data_axes, cand, cfg_run, name):
  """The figures of one compiled candidate."""
  x = bench_compiled._measure(compiled, mesh, data_axes, cfg_run["k"],
                              cand == oc.MULTISTEPS)
  x["overlap"] = _overlap(compiled, mesh, data_axes)
  x["collectives"] = _collectives(compiled, mesh, data_axes)
  text = compiled.as_text()
  x["loop_sums"] = loop_sums.accumulation_adds(text)
  if cfg_run.get("hlo_dir"):  # to read again without compiling.
    path = os.path.join(cfg_run["hlo_dir"], f"{cfg_run['compiler']}"
                        f" {name} {cand}.hlo".replace(" ", "_"))
    with open(path, "w") as f:
      f.write(text)
  return x


def _mesh_run(name, cfg_run, devices):
  mesh, data_axes, shapes, steps = oc.problem(name, cfg_run, devices)
  _warm_up(mesh)
  cands = cfg_run.get("candidates", list(
      oc.CANDIDATES if not oc.overlaps_here(cfg_run["compiler"])
      else oc.CANDIDATES[:4]))
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
        compiled, lower_s, compile_s = oc.compile_candidate(
            mesh, fn, args, cand, donate)
      except jax.errors.JaxRuntimeError as e:
        if getattr(e, "error_code_string", None) != "RESOURCE_EXHAUSTED":
          raise
        x["refused"] = str(e).splitlines()[0][:300]
        continue
      x["lower_s"].append(lower_s)
      x["compile_s"].append(compile_s)
      print(f"q. {name}, {cand}: compiled in {compile_s:.1f} s",
            file=sys.stderr, flush=True)
      if not rep:
        x.update(_read(compiled, mesh, data_axes, cand, cfg_run, name))
  return out


def in_process(cfg):
  """Every mesh of ``cfg`` compiled for its compiler setting, in this
  process; the raw figures."""
  topology, devices = oc.devices_of(cfg["compiler"])
  return {"topology": topology, "device_kind": devices[0].device_kind,
          "jax": jax.__version__, "load": harness.load_average(),
          "meshes": {name: _mesh_run(name, cfg, devices)
                     for name in cfg["meshes"]}}


def _summarize_candidate(x):
  """A candidate's figures less the per-reduction and per-sum lists."""
  x = dict(x)
  if "each" in x.get("overlap", {}):
    o = dict(x["overlap"])
    each = o.pop("each")
    o["asynchronous"] = sum(bool(e[2]) for e in each)
    o["before_last_matmul"] = sum(bool(e[2] and e[3]) for e in each)
    x["overlap"] = o
  if "sums" in x.get("loop_sums", {}):
    x["loop_sums"] = {key: val for key, val in x["loop_sums"].items()
                      if key != "sums"}
  return x


def summary(tree):
  """``tree`` (a result, or any part of one) with each candidate's
  reductions and running sums counted instead of listed."""
  if isinstance(tree, dict):
    tree = {key: summary(val) for key, val in tree.items()}
    return _summarize_candidate(tree) if "overlap" in tree or (
        "loop_sums" in tree) else tree
  if isinstance(tree, list):
    return [summary(val) for val in tree]
  return tree
