"""A data-parallel MLP step, its micro-batches in a scan or its last one
taken out, compiled for 8 chips and read by ``oa.reduction_overlap`` (not
a test).

Usage: python overlap_worker.py tpu|gpu [decoder]

test_overlap_compiled.py runs it in a child process where the compiler's
flags differ from its own (``LIBTPU_INIT_ARGS`` is read once, when libtpu
loads; ``XLA_FLAGS`` when jax starts) and for GPUs, which the CUDA plugin
offers compile-only only to a process that starts jax on the CPU platform.
It prints one JSON line: each variant's report (:func:`summary`); with
``decoder``, those of :func:`decoder_report`.
"""

import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import optax_accum as oa
from zoo import compile_only as co
from zoo import typed_model as tm

K = 4
LAYERS = 4
DIM = 256
BATCH = 256  # 8 rows per device and micro-batch on 8 devices.
# What makes XLA's TPU compiler (libtpu 0.0.42.1) overlap the reductions: its
# asynchronous all-reduce fusions, and no combining of all-reduces (its
# combiner otherwise merges the leaves' into one, synchronous). Measured in
# docs/performance.md.
TPU_OVERLAP_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true"
    " --xla_tpu_enable_async_collective_fusion_fuse_all_reduce=true"
    " --xla_enable_async_all_reduce=true"
    " --xla_jf_crs_combiner_threshold_count=1")
# XLA's GPU compiler issues all-reduces asynchronously by default; at these
# sizes (256 KiB a leaf) it combines the leaves' unless told not to.
GPU_OVERLAP_FLAGS = "--xla_gpu_all_reduce_combine_threshold_bytes=0"


def _loss(params, batch):
  x, y = batch
  for w in params:
    x = jnp.tanh(x @ w)
  return jnp.mean((x - y) ** 2)


def _local_step(peeled: bool):
  """Each device's k micro-batches in a ``lax.scan`` (``peeled``: k - 1 of
  them, the last one's value_and_grad added after it), then a ``psum`` per
  leaf, as the hand-written scan and MaxText's do."""
  grad_fn = jax.value_and_grad(_loss)

  def step(params, batch):
    params = jax.lax.pcast(params, "data", to="varying")  # own gradients.
    micro = jax.tree.map(lambda b: b.reshape(K, -1, b.shape[-1]), batch)

    def body(carry, mb):
      loss, grads = grad_fn(params, mb)
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zero = (jax.lax.pcast(jnp.zeros(()), "data", to="varying"),
            jax.tree.map(jnp.zeros_like, params))
    looped = K - 1 if peeled else K
    total, _ = jax.lax.scan(
        body, zero, jax.tree.map(lambda b: b[:looped], micro))
    if peeled:
      last = grad_fn(params, jax.tree.map(lambda b: b[looped], micro))
      total = jax.tree.map(jnp.add, total, last)
    loss, grads = total
    return jax.lax.psum(loss, "data"), [jax.lax.psum(g, "data") for g in grads]

  return step


def compile_mlp(devices, peeled: bool):
  """The step of :func:`_local_step` in a shard_map over 8 ``devices``."""
  mesh = co.mesh(devices, (8,), ("data",))
  params = co.abstract([jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)]
                       * LAYERS, mesh, [P()] * LAYERS)
  batch = co.abstract((jax.ShapeDtypeStruct((BATCH, DIM), jnp.float32),) * 2,
                      mesh, (P("data"),) * 2)
  step = jax.shard_map(_local_step(peeled), mesh=mesh,
                       in_specs=(P(), P("data")), out_specs=(P(), P()))
  with jax.set_mesh(mesh):
    return jax.jit(step).lower(params, batch).compile()


def summary(compiled) -> dict:
  """What the tests check of ``oa.reduction_overlap(compiled)``."""
  report = oa.reduction_overlap(compiled)
  return {
      "share": report.overlapped_share,
      "reductions": [[r.nbytes, r.asynchronous, r.starts_before_last_matmul,
                      r.flops_between] for r in report.reductions],
      "line": str(report),
      "peak_bytes": compiled.memory_analysis().peak_memory_in_bytes,
      # Counted once each, however XLA splits them into start and done.
      "all_reduces": oa.count_collectives(
          compiled, include_scalars=False).total.get("all-reduce", 0),
  }


# oa.value_and_grad's MLP: 8 layers, so that 7 of 8 leaves (87.5%) may
# overlap; the first layer's gradient is the last backward's last product.
OA_LAYERS = 8


def compile_value_and_grad(devices, form: str, overlap: bool = True):
  """``oa.value_and_grad(..., overlap_reduction=overlap)`` of the MLP
  (``OA_LAYERS`` layers), k = 4, data parallel over 8 ``devices``:
  ``form`` "typed" (``jax.jit``, an Explicit data axis) or "shard_map"
  (``axis_name``)."""
  mesh = co.mesh(devices, (8,), ("data",))
  params = co.abstract([jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)]
                       * OA_LAYERS, mesh, [P()] * OA_LAYERS)
  batch = co.abstract((jax.ShapeDtypeStruct((BATCH, DIM), jnp.float32),) * 2,
                      mesh, (P("data"),) * 2)
  if form == "typed":
    fn = oa.value_and_grad(_loss, num_microbatches=K, equal_weights=True,
                           overlap_reduction=overlap)
  else:
    fn = jax.shard_map(
        oa.value_and_grad(_loss, num_microbatches=K, equal_weights=True,
                          axis_name="data", overlap_reduction=overlap),
        mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(params, batch).compile()


def _checked(compiled) -> dict:
  """:func:`summary`, and whether oa.check_train_step passes (its loop and
  the last micro-batch after it: 4 micro-batches)."""
  out = summary(compiled)
  try:
    oa.check_train_step(compiled, num_microbatches=K)
    out["check"] = "ok"
  except AssertionError as e:
    out["check"] = str(e)
  return out


def report(devices) -> dict:
  out = {name: summary(compile_mlp(devices, peeled))
         for name, peeled in (("scan", False), ("peeled", True))}
  for form in ("typed", "shard_map"):
    out[f"oa {form}"] = _checked(compile_value_and_grad(devices, form))
    # The same with the last micro-batch in the loop: the peak to keep.
    out[f"oa {form}, loop whole"] = summary(
        compile_value_and_grad(devices, form, overlap=False))
  return out


# The decoder of zoo/typed_model.py in Llama 3.2 1B's proportions (a
# vocabulary 32 times the width, an FFN 6 times it), small enough to compile
# in seconds; its positional embedding broadcast, so that no leaf is reduced
# in the loop.
DECODER = tm.Config(vocab=4096, seq=128, dim=128, heads=4, ffn=768,
                    layers=6, batch_axes=("data",), pos_broadcast=True)
DECODER_BATCH = 64


def compile_decoder(devices, scan_layers: bool, overlap: bool = True):
  """``oa.value_and_grad(..., overlap_reduction=overlap)`` of
  :data:`DECODER` (``scan_layers``: its layers stacked and scanned), k = 4,
  data parallel over 8 ``devices``."""
  mesh = co.mesh(devices, (8,), ("data",))
  cfg = DECODER._replace(scan_layers=scan_layers)
  params = co.abstract(jax.eval_shape(lambda: tm.init(cfg)), mesh,
                       tm.specs(cfg))
  data = jax.eval_shape(lambda: tm.batch(cfg, DECODER_BATCH))
  data = co.abstract(data, mesh, jax.tree.map(lambda _: P("data"), data))
  fn = oa.value_and_grad(tm.loss_fn(cfg), num_microbatches=K,
                         num_tokens_fn=tm.num_tokens,
                         overlap_reduction=overlap)
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(params, data).compile()


def decoder_report(devices) -> dict:
  """The decoder's layers unrolled, with the last micro-batch out of the
  loop and kept in it, and its layers scanned, last micro-batch out."""
  return {name: summary(compile_decoder(devices, scanned, overlap))
          for name, scanned, overlap in (
              ("unrolled", False, True), ("unrolled, loop whole", False,
                                          False), ("scanned", True, True))}


if __name__ == "__main__":
  if sys.argv[1] == "gpu":
    jax.config.update("jax_platforms", "cpu")  # before any backend starts.
  devices = co.gpu_devices() if sys.argv[1] == "gpu" else co.tpu_devices()
  mode = decoder_report if sys.argv[2:] == ["decoder"] else report
  print(json.dumps(mode(devices)))
