"""Probe: a scanned layer stack's reduction inside the peeled backward loop.

Where a model stacks its layers into one leaf per weight and runs them with
``lax.scan``, the stacked leaf's gradient is final only when the whole
backward loop ends, so the one reduction of that leaf starts after it, even
with the last micro-batch peeled out of the micro-batch loop
(``overlap_reduction=True``). This probe writes by hand, in a
``jax.shard_map`` over 8 data-parallel devices, what
:func:`optax_accum.scan_layers` does: in the peeled last micro-batch, a
``custom_vjp`` scan whose backward adds each layer's running sum (of the
earlier micro-batches) to that layer's gradient and ``psum``s it inside the
backward loop, one layer at a time, instead of once after it; beside it,
the library's own (``oa.scan_layers`` as the model's layer scan under
``oa.value_and_grad(..., overlap_reduction=True)``). It measures whether
the compilers then overlap those reductions, on compile-only devices, and
checks on 8 CPU devices that the gradient is the full batch's.

The model: token embedding (4096 x 512), 16 layers ``tanh(h @ W_l)`` stacked
in one (16, 512, 512) leaf, unembedding (512 x 4096), a summed squared
error; k = 4 micro-batches of 64 rows. Variants: ``plain`` (the hand-written
peeled step reduces every leaf after the backward), ``in loop`` (the stacked
leaf reduced per layer inside it), ``library`` (``jax.shard_map`` of
``oa.value_and_grad(loss, num_microbatches=k, axis_name="data",
overlap_reduction=True, loss_reduction="sum")``, the loss's layer scan
``oa.scan_layers``) and ``library, lax.scan`` (the same with ``lax.scan``,
its control). The compiled modes print per variant the peak memory, the
report of :func:`optax_accum.reduction_overlap`, the reductions inside
loops as this probe reads them, and ``share``: the report's overlapped
share (after the loops, and inside the model's loops once per trip: an
asynchronous reduction with matrix multiplies between its start and done).
Results: ``results/scanned_layers.md``::

  python benchmarks/probe_scanned_layers.py cpu     # exactness, 8 CPUs
  python benchmarks/probe_scanned_layers.py tpu     # TPU v5e, overlap flags
  JAX_PLATFORMS=cpu python benchmarks/probe_scanned_layers.py gpu  # H100s

``tpu`` sets ``LIBTPU_INIT_ARGS`` to ``overlap_candidates.TPU_OVERLAP_FLAGS``
unless it is set; ``gpu`` takes ``XLA_FLAGS`` as given (no combining:
``--xla_gpu_all_reduce_combine_threshold_bytes=0``; optionally
``--xla_gpu_enable_pipelined_all_reduce=true``).
"""

import json
import os
import re
import sys

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

# The repository root, for the ``zoo`` package (``python
# benchmarks/probe_scanned_layers.py`` puts only benchmarks/ on sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(1, _ROOT)

import optax_accum as oa  # noqa: E402
from optax_accum._src.compiled import hlo_text  # noqa: E402
from optax_accum._src.compiled import matmul_flops  # noqa: E402
from optax_accum._src.compiled import step_reading  # noqa: E402
import overlap_candidates  # noqa: E402
from zoo import compile_only as co  # noqa: E402

LAYERS, DIM, VOCAB, BATCH, K = 16, 512, 4096, 256, 4
AXIS = "data"


def _layer(h, w):
  return jnp.tanh(h @ w)


def _scan(h, stacked):
  return lax.scan(lambda c, w: (_layer(c, w), None), h, stacked)[0]


@jax.custom_vjp
def _reducing_scan(h, stacked, running):
  del running  # read by the backward only.
  return _scan(h, stacked)


def _reducing_fwd(h, stacked, running):
  out, inputs = lax.scan(lambda c, w: (_layer(c, w), c), h, stacked)
  return out, (inputs, stacked, running)


def _reducing_bwd(residuals, g):
  inputs, stacked, running = residuals

  def body(g_h, layer):
    h, w, earlier = layer
    # This device's gradient of w: its parameter is not reduced for it.
    w = lax.pcast(w, AXIS, to="varying")
    _, vjp = jax.vjp(_layer, h, w)
    g_h, g_w = vjp(g_h)
    return g_h, lax.psum(g_w + earlier, AXIS)  # this layer's one reduction.

  g_h, g_stacked = lax.scan(body, g, (inputs, stacked, running),
                            reverse=True)
  return g_h, g_stacked, jnp.zeros_like(running)


_reducing_scan.defvjp(_reducing_fwd, _reducing_bwd)


def _loss(params, microbatch, scan):
  h = params["embed"][microbatch["ids"]]
  h = scan(h, params["layers"])
  return jnp.sum((h @ params["unembed"] - microbatch["y"]) ** 2)


def step(in_loop: bool):
  """The per-device step: k - 1 micro-batches summed, the last peeled."""

  def run(params, batch):
    local = jax.tree.map(lambda x: lax.pcast(x, AXIS, to="varying"), params)
    split = jax.tree.map(lambda x: x.reshape(K, -1, *x.shape[1:]), batch)

    def add(running, microbatch):
      g = jax.grad(_loss)(local, microbatch, _scan)
      return jax.tree.map(jnp.add, running, g), None

    running, _ = lax.scan(add, jax.tree.map(jnp.zeros_like, local),
                          jax.tree.map(lambda x: x[:-1], split))
    (held, running), last = lax.optimization_barrier(
        ((local, running), jax.tree.map(lambda x: x[-1], split)))
    if not in_loop:
      g = jax.grad(_loss)(held, last, _scan)
      return jax.tree.map(lambda a, b: lax.psum(a + b, AXIS), running, g)
    # The stacked leaf enters unreduced-free (invariant): its backward
    # returns the reduced sum itself.
    mixed = {**held, "layers": params["layers"]}
    g = jax.grad(_loss)(mixed, last, lambda h, w: _reducing_scan(
        h, w, running["layers"]))
    return {name: g[name] if name == "layers" else lax.psum(
        running[name] + g[name], AXIS) for name in g}

  return run


def _library_scan(h, stacked):
  return oa.scan_layers(lambda c, w: (_layer(c, w), None), h, stacked)[0]


def _library_step(scan):
  """The library's step: ``oa.value_and_grad`` with the last micro-batch
  peeled, the loss's layer scan ``oa.scan_layers`` or ``lax.scan``.

  The loss is a sum over rows (``loss_reduction="sum"``), each row one
  token (``num_tokens_fn``, read off the micro-batch: every id is
  non-negative): the library returns the per-row mean, the sum
  of the micro-batches' gradients over the batch's rows (``BATCH``, a power
  of two: ``BATCH`` times it is the full batch's summed gradient, exactly).
  """
  return oa.value_and_grad(
      lambda params, microbatch: _loss(params, microbatch, scan),
      num_microbatches=K, axis_name=AXIS, overlap_reduction=True,
      loss_reduction="sum",
      num_tokens_fn=lambda mb: jnp.sum(mb["ids"] >= 0, dtype=jnp.float32))


# Each variant's per-device step, and the factor that makes its gradient the
# full batch's summed gradient.
VARIANTS = {
    "plain": (lambda: step(False), 1),
    "in loop": (lambda: step(True), 1),
    "library": (lambda: _library_step(_library_scan), BATCH),
    "library, lax.scan": (lambda: _library_step(_scan), BATCH),
}


def _gradient(out):
  """The gradient of a step's output (the library's is ``(value, grads)``)."""
  return out[1] if isinstance(out, tuple) else out


def _shapes():
  params = {"embed": (VOCAB, DIM), "layers": (LAYERS, DIM, DIM),
            "unembed": (DIM, VOCAB)}
  batch = {"ids": ((BATCH,), jnp.int32), "y": ((BATCH, VOCAB), jnp.float32)}
  return ({k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in params.items()},
          {k: jax.ShapeDtypeStruct(*s) for k, s in batch.items()})


def _sharded(mesh, variant):
  return jax.shard_map(VARIANTS[variant][0](), mesh=mesh,
                       in_specs=(P(), P(AXIS)), out_specs=P())


def exactness():
  """Largest |ours - full batch| of each leaf, every variant (8 CPUs)."""
  mesh = co.mesh(jax.devices()[:8], (8,), (AXIS,))
  rng = np.random.default_rng(0)
  ps, _ = _shapes()
  params = {k: jnp.asarray(rng.normal(size=s.shape) * 0.05, jnp.float32)
            for k, s in ps.items()}
  batch = {"ids": jnp.asarray(rng.integers(0, VOCAB, BATCH), jnp.int32),
           "y": jnp.asarray(rng.normal(size=(BATCH, VOCAB)), jnp.float32)}
  full = jax.grad(_loss)(params, batch, _scan)
  out = {"full batch, largest |g|": {k: float(jnp.abs(v).max())
                                      for k, v in full.items()}}
  params = jax.device_put(params, NamedSharding(mesh, P()))
  batch = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
  for variant, (_, scale) in VARIANTS.items():
    with jax.set_mesh(mesh):
      got = _gradient(jax.jit(_sharded(mesh, variant))(params, batch))
    out[variant] = {k: float(jnp.abs(got[k] * scale - full[k]).max())
                    for k in full}
  return out


def _trips(computations):
  """How many times each while loop's body runs per step (its trip count,
  times those of the loops around it; 1 where XLA does not know it)."""
  inside = {}  # body -> (the computation holding its while, trips).
  for name, body in computations.items():
    for opcode, rest, _ in body:
      match = re.search(r"body=%?([\w.\-]+)", rest)
      if opcode == "while" and match:
        inside[match.group(1)] = (name, step_reading.trip_count(
            rest, computations) or 1)

  def times(name, seen=()):
    if name not in inside or name in seen:
      return 1
    holder, trips = inside[name]
    return trips * times(holder, seen + (name,))

  return {name: times(name) for name in computations}


def _bytes(line):
  return sum(hlo_text.ITEMSIZE[t] * int(np.prod(d))
             for t, d in hlo_text.result_shapes(line))


def _in_loop_reductions(text):
  """Gradient-sized all-reduces in loop bodies (not the entry computation):
  bytes of one, times run per step (the loop's trip count), asynchronous,
  matrix multiplies and their flops between start and done. XLA GPU's
  ``all-reduce-start``/``-done`` pairs, and XLA TPU's asynchronous
  collective fusions (``async-collective-start``, a fusion computing beside
  the all-reduce, ``async-collective-done``), read as one reduction of the
  done's bytes."""
  entry, computations = hlo_text.parse(text)
  counter = matmul_flops.Counter(computations)
  trips = _trips(computations)
  fused = {callee for body in computations.values()
           for opcode, rest, _ in body if opcode == "fusion"
           for callee in re.findall(r"calls=%?([\w.\-]+)", rest)}

  def reduces(rest):  # a fusion whose computation holds an all-reduce.
    return any(op == "all-reduce" for callee in re.findall(
        r"calls=%?([\w.\-]+)", rest) for op, _, _ in computations[callee])

  found = []
  for name, body in computations.items():
    if name == entry or name in fused:
      continue
    starts, fusion_start = {}, None
    for i, (opcode, rest, line) in enumerate(body):
      named = hlo_text.instruction_name(line)
      if opcode == "fusion" and named.startswith("async-collective-start"):
        fusion_start = i if reduces(rest) else None
        continue
      if (opcode == "fusion" and named.startswith("async-collective-done")
          and fusion_start is not None):
        start, nbytes, fusion_start = fusion_start, _bytes(line), None
      elif opcode in ("all-reduce", "all-reduce-start"):
        if _bytes(line) < 64 * 1024:
          continue
        if opcode == "all-reduce":
          found.append({"in": name, "bytes": _bytes(line),
                        "times": trips[name], "asynchronous": False,
                        "matmuls_between": 0, "flops_between": 0})
        else:
          starts[named] = (i, _bytes(line))
        continue
      elif opcode == "all-reduce-done":
        operand = rest.split("(", 1)[1].split(")")[0].split()[-1].lstrip("%")
        if operand not in starts:
          continue
        start, nbytes = starts.pop(operand)
      else:
        continue
      if nbytes < 64 * 1024:
        continue
      between = [counter.of_instruction(*body[j][:3], name)
                 for j in range(start + 1, i)]
      found.append({"in": name, "bytes": nbytes, "times": trips[name],
                    "asynchronous": True,
                    "matmuls_between": sum(m for _, m in between),
                    "flops_between": sum(f for f, _ in between)})
  return found


def compiled_reading(platform):
  devices = co.gpu_devices() if platform == "gpu" else co.tpu_devices()
  mesh = co.mesh(devices, (8,), (AXIS,))
  ps, bs = _shapes()
  ps = co.abstract(ps, mesh, jax.tree.map(lambda _: P(), ps))
  bs = co.abstract(bs, mesh, jax.tree.map(lambda _: P(AXIS), bs))
  out = {"flags": os.environ.get("XLA_FLAGS" if platform == "gpu"
                                 else "LIBTPU_INIT_ARGS", "")}
  for variant in VARIANTS:
    with jax.set_mesh(mesh):
      compiled = jax.jit(_sharded(mesh, variant)).lower(ps, bs).compile()
    report = oa.reduction_overlap(compiled)
    inside = _in_loop_reductions(compiled.as_text())
    out[variant] = {
        "peak_MiB": compiled.memory_analysis().peak_memory_in_bytes / 2**20,
        "report": str(report),
        "inside loops": inside,
        # oa.reduction_overlap reads the reductions inside the model's
        # loops too (each trip's): the share of all gradient reduction
        # bytes overlapped, after the loops and inside them.
        "share": report.overlapped_share,
    }
  return out


if __name__ == "__main__":
  where = sys.argv[1]
  if where == "cpu":
    jax.config.update("jax_num_cpu_devices", 8)
  elif where == "tpu":  # read when libtpu loads, at the first compile.
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ.setdefault("LIBTPU_INIT_ARGS",
                          overlap_candidates.TPU_OVERLAP_FLAGS)
  else:
    jax.config.update("jax_platforms", "cpu")  # compile-only GPUs.
  print(json.dumps(exactness() if where == "cpu" else compiled_reading(where),
                   indent=1))
