"""Unreduced gradients under jit: one reduction per update across jit calls.

With one jit call per micro-batch (PyTorch DDP's ``no_sync`` loop), a
gradient typed *unreduced* over the data axes (``float32[...]{U:data}``,
:func:`optax_accum.value_and_grad` with ``gradient_sync="deferred"``) holds
each device's partial: summed over the devices it is the batch's gradient.
:func:`optax_accum.accumulate` built with ``axis_name`` keeps such partials in
its per-device slots (the layout of :mod:`partial_sums`, so that the state is
an ordinary sharded array that checkpoints and
:func:`optax_accum.state_partition_specs` handle) and reduces them once, in
the emitting branch.

JAX refuses most arithmetic on unreduced arrays (a product with a replicated
scalar, ``isfinite``, ``where``), so the micro-step's local arithmetic runs
in a :func:`jax.shard_map` over the data axes, where each device sees its own
partial as a plain array. Moving a partial between the unreduced type and a
slot is free; the reduction is :func:`jax.sharding.reshard` to the
parameters' sharding.

A parameter sharded over some of the data axes (FSDP, HSDP) gets its
gradient reduce-scattered over those axes each call; its slots span only the
remaining data axes (:func:`slot_axes`).
"""

import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


def unreduced_axes(x: Any) -> frozenset[str]:
  """The mesh axes over which ``x``'s type says it is unreduced."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  return frozenset(getattr(spec, "unreduced", ()))


def slot_axes(param_spec: P | None,
              axis_name: readers.AxisName) -> tuple[str, ...]:
  """The data axes a parameter's gradient stays unreduced over.

  Those of ``axis_name`` that do not shard the parameter: over the others
  its gradient is reduce-scattered on every call.
  """
  used = set()
  for entry in param_spec or ():
    used.update(readers.axes_of(entry) if entry is not None else ())
  return tuple(a for a in readers.axes_of(axis_name) if a not in used)


def slot_zeros(param: Any, dtype: Any, axis_name: readers.AxisName) -> Any:
  """A parameter's per-device slots under a mesh, sharded like it.

  The leading slot axis spans :func:`slot_axes`; the other dimensions keep
  the parameter's (Explicit) sharding.
  """
  spec = readers.explicit_spec(param) or P()
  over = slot_axes(spec, axis_name)
  sizes = dict(jax.sharding.get_abstract_mesh().shape)
  slots = math.prod(sizes[a] for a in over)
  entries = list(spec) + [None] * (jnp.ndim(param) - len(spec))
  return jnp.zeros(
      (slots,) + jnp.shape(param), dtype,
      out_sharding=P(readers.entry(over), *entries),
  )


def _slot_spec(slots: Any) -> P:
  """The spec of a slot-holding state leaf, from its type."""
  spec = readers.explicit_spec(slots)
  if spec is None or (spec[0] is None and jnp.shape(slots)[0] != 1):
    raise ValueError(
        "The state's running sums are not laid out one slot per device:"
        " call tx.init(params) under jax.set_mesh(mesh) with Explicit axes"
        " (and, for sharded parameters, on parameters carrying their"
        f" sharding), got a sum typed {jax.typeof(slots)}."
    )
  return spec


def check_grads(grads: Any, grad_sum: Any, axis_name: readers.AxisName,
                looked_at: bool) -> None:
  """Each gradient must be unreduced over exactly its slots' axes.

  A gradient that is already reduced (replicated) would be added on every
  device, counted once per device: refused. ``looked_at`` is False for a
  flush (``num_tokens=0``), whose zeros are never added.
  """
  if (readers.mesh_axis_size(axis_name) is None
      or not readers.all_explicit(axis_name)):
    axes.check_bound(axis_name)  # raises, saying where it works.
  flat = jax.tree_util.tree_leaves_with_path(grads)
  for (path, g), s in zip(flat, jax.tree.leaves(grad_sum)):
    spec = _slot_spec(s)
    want = frozenset(readers.axes_of(spec[0]) if spec[0] is not None else ())
    have = unreduced_axes(g)
    if have == want or (not looked_at and not have):
      continue
    where = f"updates{jax.tree_util.keystr(path)}"
    if not have:
      raise ValueError(
          f"{where} is not unreduced over {sorted(want)} (its type is"
          f" {jax.typeof(g)}): under jax.jit, accumulate(axis_name="
          f"{axis_name!r}) takes per-device partial gradients, and would"
          " count an already reduced gradient once per device. Take the"
          " gradient with optax_accum.value_and_grad(..., axis_name="
          f"{axis_name!r}, gradient_sync='deferred'), call tx.update inside"
          " jax.shard_map on device-local gradients, or build accumulate"
          " with axis_name=None for reduced gradients."
      )
    raise ValueError(
        f"{where} is unreduced over {sorted(have)}, but the state keeps its"
        f" per-device sums over {sorted(want)} (accumulate(axis_name="
        f"{axis_name!r}) and the parameter's sharding): give accumulate the"
        " axis_name that value_and_grad's gradient_sync='deferred' used."
    )


def summed_like(grads: Any) -> Any:
  """``grads`` once reduced: their shapes, typed without ``unreduced``."""
  return jax.tree.map(
      lambda g: jax.ShapeDtypeStruct(
          jnp.shape(g), jnp.result_type(g),
          sharding=P(*readers.partitions(readers.full_spec(g)))),
      grads,
  )


def is_first_device(axis_name: readers.AxisName) -> jax.Array:
  """In :func:`manual.on_own_partials`: whether this is the data axes'
  device 0.

  Counts that are the same on every device (the global token count, a
  global drop) go into device 0's slot only, so that the sum over the slots
  counts them once.
  """
  return lax.axis_index(readers.axes_of(axis_name)) == 0


def any_device(flag: jax.Array, axis_name: readers.AxisName) -> jax.Array:
  """In :func:`manual.on_own_partials`: whether ``flag`` holds anywhere."""
  return lax.psum(flag.astype(jnp.int32), readers.axes_of(axis_name)) > 0


def sum_slots(slots: Any) -> Any:
  """The sum over a leaf's slots, sharded like its parameter.

  Viewing the slots as one unreduced array is free; the reshard to the
  parameter's sharding is the reduction (an all-reduce, or nothing for a
  parameter sharded over every data axis).
  """
  spec = _slot_spec(slots)
  over = frozenset(readers.axes_of(spec[0]) if spec[0] is not None else ())
  rest = P(*spec[1:])
  if not over:
    return slots.reshape(slots.shape[1:])
  unreduced = manual.on_own_partials(
      lambda s: s.reshape(s.shape[1:]), (slots,),
      P(*readers.partitions(rest), unreduced=over),
  )
  return jax.sharding.reshard(unreduced, rest)

