"""Benchmark q's programs: compiler settings, meshes and candidates.

Each candidate is one update of ``k`` micro-batches on benchmark k's decoder
(``zoo/typed_model.py``), lowered and compiled for compile-only devices
(:func:`compile_candidate`), never run.
"""

import inspect
import time
import warnings

import jax
from jax.sharding import PartitionSpec as P

import bench_compiled
import optax_accum as oa
from optax_accum._src.microbatch import trip_count
from zoo import compile_only as co
from zoo import peers
from zoo import typed_model as tm

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

# Benchmark k's meshes, and on 8 data-parallel devices the parameters
# replicated ("data") or, with ZeRO-1, the gradient reduce-scattered into
# oa.zero_specs's shards (gradient_sync="once").
MESHES = {**bench_compiled.MESHES,
          "data": ((8,), ("data",), {"batch_axes": ("data",)}),
          "ZeRO-1": ((8,), ("data",), {"batch_axes": ("data",)})}
# A mesh named "<mesh>, scanned layers" runs the decoder with its layers
# stacked (``scan_layers``): one leaf per weight, the blocks in a lax.scan.
SCANNED = ", scanned layers"


def mesh_and_model(name, cfg_run):
  """The mesh of ``MESHES`` that ``name`` names, and ``cfg_run`` with the
  model's layers stacked where ``name`` asks for it."""
  if not name.endswith(SCANNED):
    return name, cfg_run
  model = {**cfg_run["model"], "scan_layers": True}
  return name.removesuffix(SCANNED), {**cfg_run, "model": model}


def overlaps_here(setting):
  """Whether the compiler setting issues reductions asynchronously."""
  return setting != "TPU v5e, defaults"


def devices_of(setting):
  """``(topology, compile-only devices)`` of a compiler setting."""
  if COMPILERS[setting][0] == "gpu":
    return "8 x H100 SXM", co.gpu_devices()
  return TOPOLOGY, co.tpu_devices(TOPOLOGY)


def problem(name, cfg_run, devices):
  """The mesh, the data axes and each candidate's function and arguments."""
  name, cfg_run = mesh_and_model(name, cfg_run)
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
  # ZeRO-1's hand-written peer reshards its gradient into the same shards.
  scan = peers.token_weighted_scan(loss_fn, k, data_axes, n_data,
                                   out_specs=zero.get("param_specs"))
  steps = {SCAN: (scan, whole, ())}
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


def compile_candidate(mesh, fn, args, cand, donate=()):
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
