"""Compile-only TPU and GPU devices for the tests of SPEC 11 and benchmark k.

XLA compiles for hardware this machine lacks: with libtpu installed (the
``tpu`` extra), ``jax.experimental.topologies.get_topology_desc`` gives
compile-only TPU devices; with the CUDA plugin and ptxas (the ``gpu`` extra)
and a GPU target config, compile-only GPUs. Programs are lowered from
abstract inputs (``jax.ShapeDtypeStruct`` with shardings over those
devices) and compiled; nothing runs. ``tests/compiled/test_compiled_tpu.py``
and ``tests/compiled/test_compiled_gpu.py`` (through its child process,
``tests/support/compiled_gpu_worker.py``) use these helpers, and skip, saying
why, where the extra is not installed; so does
``benchmarks/bench_compiled.py``.
"""

import functools
import importlib.util
import math
import os
import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_accum as oa
from optax_accum._src.compiled import hlo

# The H100 target config of XLA's repository, as jaxlib 0.10.2 parses it.
H100_CONFIG = pathlib.Path(__file__).parent / "data" / "h100_sxm.txtpb"
# A reduction of more bytes is gradient-sized; fewer: scalars.
MIN_GRADIENT_BYTES = 64


def missing_tpu() -> str | None:
  """Why compile-only TPU devices are unavailable here, or None."""
  if importlib.util.find_spec("libtpu") is None:
    return ("libtpu is not installed: pip install 'optax-accum[tpu]' to"
            " compile for TPUs on this machine.")
  return None


def missing_gpu() -> str | None:
  """Why compile-only GPUs are unavailable here, or None."""
  for module, extra in (("jax_plugins.xla_cuda12", "jax-cuda12-plugin"),
                        ("nvidia.cuda_nvcc", "nvidia-cuda-nvcc-cu12")):
    try:
      found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
      found = False
    if not found:
      return (f"{extra} is not installed: pip install 'optax-accum[gpu]' to"
              " compile for GPUs on this machine.")
  return None


@functools.cache
def tpu_devices(topology: str = "v5e:2x4") -> tuple[jax.Device, ...]:
  """The compile-only TPU devices of ``topology`` (libtpu loads once).

  libtpu refuses to load while another process holds it (a benchmark
  compiling for a slice, another test run) unless told that this is fine:
  nothing here runs on a TPU.
  """
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return tuple(topologies.get_topology_desc(
      platform="tpu", topology_name=topology).devices)


@functools.cache
def gpu_devices(topology: str = "1x1x8") -> tuple[jax.Device, ...]:
  """Compile-only H100s: ``topology`` is slices x hosts x GPUs per host."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return tuple(topologies.get_topology_desc(
      platform="cuda", topology=topology,
      target_config=H100_CONFIG.read_text()).devices)


def mesh(devices, shape, names, axis_type=AxisType.Explicit) -> Mesh:
  return Mesh(np.array(devices).reshape(shape), names,
              axis_types=(axis_type,) * len(names))


def abstract(tree, mesh_, specs):
  """ShapeDtypeStructs of ``tree``'s leaves, sharded by ``specs``."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(mesh_, s)), tree, specs)


def data_reductions(compiled, mesh_, data_axes):
  """The gradient-sized all-reduces and reduce-scatters over data axes."""
  return [c for c in hlo.collectives(compiled, mesh_)
          if c.collective in ("all-reduce", "reduce-scatter")
          and set(c.axes) & set(data_axes)
          and c.nbytes >= MIN_GRADIENT_BYTES]


def replicated_bytes(params, axis) -> int:
  """The bytes of the parameters not sharded over ``axis``."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)
             if axis not in jax.tree.leaves(tuple(x.sharding.spec)))


def reduced_bytes(c, mesh_) -> int:
  """The bytes of gradient a reduction sums (a reduce-scatter's whole)."""
  if c.collective == "reduce-scatter":
    return c.nbytes * math.prod(mesh_.shape[a] for a in c.axes)
  return c.nbytes


def zero_step(grad_fn, opt, specs):
  """A ZeRO update step: ``grad_fn``'s gradient (already in the shards of
  ``specs``, from ``param_specs=specs``) into ``opt``, whose state is sharded
  by ``specs``; the updates resharded back to the parameters' layout (the
  all-gather) and applied. Returns ``step(params, opt_state, batch) ->
  (params, opt_state, loss)``."""

  def step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state,
                                    jax.sharding.reshard(params, specs))
    updates = jax.tree.map(
        lambda u, p: jax.sharding.reshard(u, jax.typeof(p).sharding.spec),
        updates, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def zero_state(opt, params, mesh_, specs):
  """The abstract state of ``opt`` for ``params`` sharded by ``specs``."""
  with jax.set_mesh(mesh_):
    return jax.eval_shape(opt.init, jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                          sharding=NamedSharding(mesh_, s)),
        params, specs))


EMIT_KINDS = ("update_and_apply", "apply_if_updated", "MultiSteps")


def emit_step(kind, inner, k=4):
  """``(init, step)`` of one micro-step, ``step(params, state, grads) ->
  (params, state)``; ``kind`` is one of :data:`EMIT_KINDS`:
  ``oa.update_and_apply``, ``tx.update`` + ``oa.apply_if_updated`` (both
  of ``oa.accumulate``), or ``optax.MultiSteps`` + ``optax.apply_updates``.
  """
  if kind == "MultiSteps":
    tx = optax.MultiSteps(inner, every_k_schedule=k)
  else:
    tx = oa.accumulate(inner, every_k=k, equal_weights=True)

  def step(params, state, grads):
    if kind == "update_and_apply":
      return oa.update_and_apply(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    if kind == "MultiSteps":
      return optax.apply_updates(params, updates), state
    return oa.apply_if_updated(params, updates, state), state

  return tx.init, step


NNX_EMIT_KINDS = ("MultiSteps", "nnx.Optimizer.update", "update_and_apply")


def nnx_emit_peak(device, kind, inner, leaves=4, size=1024, k=4) -> int:
  """The peak of one donated micro-step inside an ``nnx.Optimizer``,
  compiled for ``device``: ``kind`` is one of :data:`NNX_EMIT_KINDS`,
  ``optimizer.update(model, grads)`` with ``optax.MultiSteps`` or with
  ``oa.accumulate``, or ``oa.update_and_apply`` written back with
  ``nnx.update`` (docs/flax.md). The model and optimizer are split, their
  state and the gradients donated to one ``jax.jit``."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  as_pure = getattr(nnx, "as_pure", None) or nnx.pure

  class Model(nnx.Module):
    def __init__(self):
      for i in range(leaves):
        setattr(self, f"w{i}", nnx.Param(jnp.zeros((size, size))))

  def make():
    model = Model()
    tx = (optax.MultiSteps(inner, every_k_schedule=k) if kind == "MultiSteps"
          else oa.accumulate(inner, every_k=k, equal_weights=True))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  model, optimizer = nnx.eval_shape(make)
  graphdef, state = nnx.split((model, optimizer))

  def step(state, grads):
    model, optimizer = nnx.merge(graphdef, state)
    if kind == "update_and_apply":
      params, opt_state = oa.update_and_apply(
          optimizer.tx, as_pure(grads), as_pure(optimizer.opt_state),
          as_pure(nnx.state(model, nnx.Param)))
      nnx.update(model, params)
      nnx.update(optimizer.opt_state, nnx.state(opt_state))
    else:
      optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  mesh_ = mesh([device], (1,), ("x",))
  on_device = lambda tree: abstract(tree, mesh_, jax.tree.map(lambda _: P(),
                                                             tree))
  with jax.set_mesh(mesh_):
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        on_device(state), on_device(nnx.state(model, nnx.Param))).compile()
  return compiled.memory_analysis().peak_memory_in_bytes


def emit_peak(device, kind, inner, leaves=4, size=1024, k=4) -> int:
  """The peak of one donated :func:`emit_step` on ``device``, compiled:
  ``leaves`` float32 parameters of ``size`` x ``size``, the gradients
  passed in."""
  mesh_ = mesh([device], (1,), ("x",))
  params = abstract(
      {f"w{i}": jax.ShapeDtypeStruct((size, size), jnp.float32)
       for i in range(leaves)}, mesh_, {f"w{i}": P() for i in range(leaves)})
  init, step = emit_step(kind, inner, k)
  with jax.set_mesh(mesh_):
    state = jax.eval_shape(init, params)
  state = abstract(state, mesh_, jax.tree.map(lambda _: P(), state))
  with jax.set_mesh(mesh_):
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
        params, state, params).compile()
  return compiled.memory_analysis().peak_memory_in_bytes
