"""A probe: the one reduction hidden on a model whose layers ``nnx.scan`` runs.

Not in the registry. A Flax NNX model in a decoder's proportions without its
attention (vocabulary 16384, width 256, 16 blocks of a 256 -> 1024 -> 256
MLP with a residual, their weights stacked by ``nnx.vmap``, an untied
embedding and unembedding: 16.8M parameters, 64 MiB of float32 gradient), a
batch of 64 sequences of 128 tokens, k = 4, data parallel over 8 devices by
``jax.shard_map`` with ``axis_name``. Its blocks run by ``nnx.scan``, and the
same weights read in the module (``self.blocks.up.kernel[...]``) and run by
``oa.scan_layers``. Candidates: ``oa.value_and_grad`` with
``overlap_reduction`` off (today) and on (ours), and the hand-written
token-weighted ``lax.scan`` of ``jax.grad`` (scan). Each is compiled, never
run, and read: ``oa.reduction_overlap``'s share, the peak per device, the
compile time. Figures: ``results/q_decoder.md``, last section.

  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_gpu_all_reduce_combine_threshold_bytes=0 \\
      python benchmarks/probe_nnx_scan.py gpu     # the gpu extra
  LIBTPU_INIT_ARGS="<overlap_candidates.TPU_OVERLAP_FLAGS>" \\
      python benchmarks/probe_nnx_scan.py tpu     # the tpu extra
"""

import os
import sys
import time

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

# The repository root, for the ``zoo`` package (``python
# benchmarks/probe_nnx_scan.py`` puts only benchmarks/ on sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(1, _ROOT)

import optax_accum as oa  # noqa: E402
from zoo import compile_only  # noqa: E402

VOCAB, WIDTH, HIDDEN, LAYERS, SEQ, BATCH, K = 16384, 256, 1024, 16, 128, 64, 4
SCANS = ("nnx.scan", "oa.scan_layers")


class Block(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
  """The blocks stacked by ``nnx.vmap``, run as ``scan`` says."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(rngs)

    self.blocks = blocks(rngs)
    self.unembed = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, ids, scan):
    x = self.embed(ids)
    if scan == "nnx.scan":
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x)
      x = body(x, self.blocks)
    else:
      b = self.blocks
      weights = (b.up.kernel[...], b.up.bias[...], b.down.kernel[...],
                 b.down.bias[...])

      def layer(h, w):
        up, up_bias, down, down_bias = w
        return h + jax.nn.gelu(h @ up + up_bias) @ down + down_bias, None

      x, _ = oa.scan_layers(layer, x, weights)
    return self.unembed(x)


def _count(mb):
  return mb["mask"].sum()


def _loss(graphdef, scan):
  def loss(state, mb):
    logits = nnx.merge(graphdef, state)(mb["ids"], scan).astype(jnp.float32)
    picked = jnp.take_along_axis(logits, mb["ids"][..., None], -1)[..., 0]
    nll = jax.nn.logsumexp(logits, -1) - picked
    return (nll * mb["mask"]).sum() / jnp.maximum(_count(mb), 1.0)
  return loss


def _hand_scan(loss):
  """The token-weighted ``lax.scan`` of ``jax.grad``, reduced after it."""
  def step(params, batch):
    mbs = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)

    def body(carry, mb):
      value, grads = jax.value_and_grad(
          lambda p: loss(p, mb) * _count(mb))(params)
      return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    zeros = jax.tree.map(lambda z: lax.pcast(z, ("data",), to="varying"),
                         zeros)
    (value, grads), _ = lax.scan(body, zeros, mbs)
    tokens = jnp.maximum(lax.psum(_count(batch), "data"), 1.0)
    return (lax.psum(value, "data") / tokens,
            jax.tree.map(lambda g: lax.psum(g, "data") / tokens, grads))
  return step


def measure(platform):
  """One row per scan and candidate: share, peak MiB, compile seconds."""
  devices = (compile_only.tpu_devices() if platform == "tpu"
             else compile_only.gpu_devices())
  mesh = Mesh(np.array(devices), ("data",), axis_types=(AxisType.Explicit,))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))),
                              nnx.Param)
  whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole), state)
  batch = {"ids": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32,
                                       sharding=rows),
           "mask": jax.ShapeDtypeStruct((BATCH, SEQ), jnp.float32,
                                        sharding=rows)}
  found = []
  for scan in SCANS:
    loss = _loss(graphdef, scan)
    for cand in ("today", "ours", "scan"):
      fn = _hand_scan(loss) if cand == "scan" else oa.value_and_grad(
          loss, num_microbatches=K, num_tokens_fn=_count, axis_name="data",
          overlap_reduction=cand == "ours")
      step = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                                   out_specs=P()))
      jax.clear_caches()
      start = time.perf_counter()
      with jax.set_mesh(mesh):
        compiled = step.lower(params, batch).compile()
      seconds = time.perf_counter() - start
      overlap = oa.reduction_overlap(compiled, data_axes="data", mesh=mesh)
      peak = compiled.memory_analysis().peak_memory_in_bytes / 2**20
      found.append((scan, cand, overlap.overlapped_share, peak, seconds,
                    overlap.num_reductions, overlap.total_bytes / 2**20))
  return found


if __name__ == "__main__":
  for row in measure(sys.argv[1] if len(sys.argv) > 1 else "gpu"):
    print("{} | {} | {:.1%} | {:.1f} MiB | {:.0f} s | {} reductions,"
          " {:.1f} MiB".format(*row))
