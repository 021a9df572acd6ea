"""A scanned layer stack's step, through ``oa.scan_layers`` and through
``lax.scan``, compiled for 8 chips and read by ``oa.reduction_overlap``
(not a test).

Usage: python scan_layers_overlap_worker.py tpu|gpu

The model of ``benchmarks/probe_scanned_layers.py``, smaller: a token
embedding (512 x 128), 8 layers ``tanh(h @ W_l)`` stacked in one
(8, 128, 128) leaf, an unembedding (128 x 512), a summed squared error; its
stack holds half the gradient's bytes. ``jax.shard_map`` of
``oa.value_and_grad(..., overlap_reduction=True)`` over 8 data-parallel
devices, k = 4. test_model_loops_compiled.py runs it in a child process,
whose compiler flags are its own (``LIBTPU_INIT_ARGS``, ``XLA_FLAGS``), and
for GPUs, which the CUDA plugin offers compile-only only to a process that
starts jax on the CPU platform. It prints one JSON line: each variant's
report.
"""

import json
import sys

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import helpers
import optax_accum as oa
import overlap_worker
from zoo import compile_only as co

LAYERS, DIM, VOCAB, BATCH, K = 8, 128, 512, 256, 4


def compile_step(devices, scan):
  """The step whose layer scan is ``scan``, compiled for 8 ``devices``."""
  mesh = co.mesh(devices, (8,), ("data",))
  shapes = {"embed": (VOCAB, DIM), "layers": (LAYERS, DIM, DIM),
            "unembed": (DIM, VOCAB)}
  params = co.abstract(
      {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()},
      mesh, {k: P() for k in shapes})
  batch = co.abstract(
      {"ids": jax.ShapeDtypeStruct((BATCH,), jnp.int32),
       "y": jax.ShapeDtypeStruct((BATCH, VOCAB), jnp.float32)},
      mesh, {"ids": P("data"), "y": P("data")})
  step = oa.value_and_grad(
      helpers.stacked_layers_loss(scan), num_microbatches=K, axis_name="data",
      overlap_reduction=True, loss_reduction="sum",
      num_tokens_fn=lambda mb: jnp.sum(mb["ids"] >= 0, dtype=jnp.float32))
  step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                       out_specs=P())
  with jax.set_mesh(mesh):
    return jax.jit(step).lower(params, batch).compile()


def summary(compiled) -> dict:
  """``overlap_worker.summary``, with the total bytes and the reductions
  inside the model's loop."""
  report = oa.reduction_overlap(compiled)
  return dict(
      overlap_worker.summary(compiled), total_bytes=report.total_bytes,
      in_loops=[[r.nbytes, r.trips, r.asynchronous, r.flops_between]
                for r in report.loop_reductions])


if __name__ == "__main__":
  if sys.argv[1] == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  devices = co.gpu_devices() if sys.argv[1] == "gpu" else co.tpu_devices()
  print(json.dumps({
      name: summary(compile_step(devices, scan))
      for name, scan in (("scan_layers", oa.scan_layers),
                         ("lax.scan", lax.scan))}))
