"""The report of test_compiled_gpu.py, in its own process (not a test).

Usage: python compiled_gpu_worker.py

The CUDA plugin offers compile-only GPUs (``zoo.compile_only``) only to a
process that starts jax on the CPU platform, so test_compiled_gpu.py runs
this script with the repository root on ``PYTHONPATH`` and reads the JSON
it prints last: the collectives of the typed form compiled for 8 H100s.
"""

import json
import warnings

import jax
from jax.sharding import PartitionSpec as P
import optax

import optax_accum as oa
from optax_accum._src.compiled import hlo
from zoo import compile_only as co
from zoo import peers
from zoo import typed_model as tm


def _problem(devices, shape, names, axes):
  """The mesh, a one-layer decoder over it, its parameters and a batch of 64
  sequences sharded over the first axis (abstract)."""
  mesh_ = co.mesh(devices, shape, names)
  cfg = tm.Config(vocab=512, seq=128, dim=128, heads=4, ffn=512, layers=1,
                  batch_axes=(names[0],), **axes)
  params = co.abstract(jax.eval_shape(lambda: tm.init(cfg)), mesh_,
                       tm.specs(cfg))
  data = jax.eval_shape(lambda: tm.batch(cfg, 64))
  data = co.abstract(data, mesh_,
                     jax.tree.map(lambda _: P(names[0]), data))
  return mesh_, cfg, params, data


def gpu_report() -> dict:
  """What test_compiled_gpu.py checks, read from 8 compile-only H100s.

  Run in a child process: the CUDA plugin offers compile-only GPUs only when
  jax starts on the CPU platform (``jax_platforms="cpu"`` before any use).
  """
  devices = co.gpu_devices()
  out = {"device_kind": devices[0].device_kind}
  for name, shape, names, axes in (
      ("data x tensor", (4, 2), ("data", "tensor"), {"tensor": "tensor"}),
      ("fsdp", (8,), ("fsdp",), {"fsdp": "fsdp"})):
    mesh_, cfg, params, data = _problem(devices, shape, names, axes)
    fn = oa.value_and_grad(tm.loss_fn(cfg), num_microbatches=4,
                           num_tokens_fn=tm.num_tokens)
    with jax.set_mesh(mesh_), warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      compiled = jax.jit(fn).lower(params, data).compile()
    text = compiled.as_text()
    out[name] = {
        "same_counts": all(
            oa.count_collectives(compiled, mesh=mesh_, **kw)
            == oa.count_collectives(text, mesh=mesh_, **kw)
            for kw in ({}, {"include_scalars": False})),
        # Every data-axis collective that is left with include_scalars=False
        # is gradient-sized: no combined scalars among them.
        "small_unscalar": [
            c.nbytes for c in hlo.collectives(compiled, mesh_)
            if set(c.axes) & {names[0]} and not c.scalar
            and c.nbytes < co.MIN_GRADIENT_BYTES],
        "combined_scalars": sum(
            1 for c in hlo.collectives(compiled, mesh_)
            if c.scalar and _elements_of(c) > 1),
        "reductions": [[c.collective, c.nbytes, c.looped] for c in
                       co.data_reductions(compiled, mesh_, (names[0],))],
        "pos_bytes": cfg.seq * cfg.dim * 4,
        "replicated_bytes": co.replicated_bytes(params, names[0]),
    }
  out["scan_peaks"] = _scan_peaks(devices)
  out["zero"] = _zero_report(devices)
  out["emit"] = {
      name: {kind: co.emit_peak(devices[0], kind, opt)
             for kind in co.EMIT_KINDS}
      for name, opt in (("adamw", optax.adamw(1e-3)),
                        ("muon", optax.contrib.muon(1e-3)))}
  out["nnx_emit"] = {kind: co.nnx_emit_peak(devices[0], kind,
                                            optax.adamw(1e-3))
                     for kind in co.NNX_EMIT_KINDS}
  return out


def _zero_report(devices) -> dict:
  """SPEC 12 on data x tensor: adamw's state sharded over data by
  oa.zero_specs; per gradient_sync, the data reductions and the all-gathers
  after the loop, and the bytes the norms and 'pos' may all-reduce."""
  mesh_, cfg, params, data = _problem(
      devices, (4, 2), ("data", "tensor"), {"tensor": "tensor"})
  opt = optax.adamw(1e-3)
  with jax.set_mesh(mesh_):
    specs = oa.zero_specs(params, "data")
  out = {"whole_bytes": cfg.seq * cfg.dim * 4 + sum(
      p.size * p.dtype.itemsize for p in jax.tree.leaves(params)
      if p.ndim == 1)}
  for sync in ("once", "every_microbatch"):
    step = co.zero_step(oa.value_and_grad(
        tm.loss_fn(cfg), num_microbatches=4, num_tokens_fn=tm.num_tokens,
        param_specs=specs, gradient_sync=sync), opt, specs)
    with jax.set_mesh(mesh_), warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      compiled = jax.jit(lambda *a, step=step: step(*a)[:2]).lower(
          params, co.zero_state(opt, params, mesh_, specs), data).compile()
    out[sync] = {
        "reductions": [[c.collective, c.nbytes, c.looped] for c in
                       co.data_reductions(compiled, mesh_, ("data",))],
        "gathers": sum(1 for c in hlo.collectives(compiled, mesh_)
                       if c.collective == "all-gather" and "data" in c.axes
                       and not c.looped),
        "peak": compiled.memory_analysis().peak_memory_in_bytes,
    }
  return out


def _scan_peaks(devices) -> dict:
  """On a data-only mesh, an embedding-heavy decoder (vocabulary 32768,
  width 512, one layer, k = 4): the peak of the default path and of the
  hand-written token-weighted scan (zoo/peers.py), compiled alike."""
  mesh_ = co.mesh(devices, (8,), ("data",))
  cfg = tm.Config(vocab=32768, seq=128, dim=512, heads=4, ffn=1024,
                  layers=1, batch_axes=("data",))
  params = co.abstract(jax.eval_shape(lambda: tm.init(cfg)), mesh_,
                       tm.specs(cfg))
  data = jax.eval_shape(lambda: tm.batch(cfg, 64))
  data = co.abstract(data, mesh_, jax.tree.map(lambda _: P("data"), data))
  peaks = {}
  for name, fn in (
      ("typed", oa.value_and_grad(tm.loss_fn(cfg), num_microbatches=4,
                                  num_tokens_fn=tm.num_tokens)),
      ("scan", peers.token_weighted_scan(tm.loss_fn(cfg), 4, ("data",), 8))):
    with jax.set_mesh(mesh_), warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      compiled = jax.jit(fn).lower(params, data).compile()
    peaks[name] = compiled.memory_analysis().peak_memory_in_bytes
  return peaks


def _elements_of(c) -> int:
  """A scalar collective's result size, in 4-byte elements (f32 or s32)."""
  return c.nbytes // 4


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  print(json.dumps(gpu_report()))
