"""Per-device partial sums: kept apart through a cycle, summed once.

Gradient accumulation over ``n`` devices should communicate once per optimizer
update. Each device keeps the sum of its own micro-batches' gradients (its
*partial sum*), and the partial sums are added over the data-parallel axis
once, when the update is made. In :func:`optax_accum.accumulate`'s state a
partial sum sits behind a leading *slot* axis: one slot per device, so that a
shard_map whose specs lay the slots out over the axis keeps every device's
partial sum (a replicated spec would keep one and drop the others).
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers


def partial_zeros(shape: Sequence[int], dtype: Any, axis_name: readers.AxisName):
  """Zeros for per-device partial sums: ``shape`` behind a leading slot axis.

  Inside shard_map or pmap each device has one slot. Under a mesh
  (:func:`jax.set_mesh`) with ``axis_name`` the slot axis has one slot per
  device and is sharded over it, ready for the ``in_specs`` that
  :func:`optax_accum.state_partition_specs` gives. With neither, one slot:
  replicate it for pmap.
  """
  shape = tuple(shape)
  slots = None if axes.is_bound(axis_name) else readers.mesh_axis_size(axis_name)
  if slots is None:
    return jnp.zeros((1,) + shape, dtype)
  spec = P(axis_name)
  if readers.all_explicit(axis_name):
    return jnp.zeros((slots,) + shape, dtype, out_sharding=spec)
  return lax.with_sharding_constraint(jnp.zeros((slots,) + shape, dtype), spec)


def slots_sharded_by_type(axis_name: readers.AxisName) -> bool:
  """Whether :func:`partial_zeros` lays slots out over Explicit mesh axes."""
  return (not axes.is_bound(axis_name)
          and readers.mesh_axis_size(axis_name) is not None
          and readers.all_explicit(axis_name))


def sum_partials(tree: Any, axis_name: readers.AxisName) -> Any:
  """Sums per-device partial sums (with a leading slot axis) over an axis."""
  axes.check_bound(axis_name)
  return compat.summed_in_float32(
      lambda t: lax.psum(t, axis_name),
      jax.tree.map(lambda x: x.reshape(x.shape[1:]), tree))


def like_summed(tree: Any, axis_name: readers.AxisName | None) -> Any:
  """``tree`` summed over the axis: for shapes (eval_shape) only."""
  if axis_name is None:
    return tree
  axes.check_bound(axis_name)
  return lax.psum(tree, axis_name)


def zeros_like_partials(tree: Any) -> Any:
  """Zeros typed like ``tree``: same sharding, varying over the same axes.

  The two branches of a ``lax.cond`` must agree on both.

  Each leaf is filled from its own entry of a vector of zeros that an
  optimization barrier hides from XLA. Identical ``zeros`` of same-shaped
  leaves would be merged into one buffer by XLA's CSE, which a conditional
  then copies into each of its outputs: one extra read and write per leaf on
  every non-emitting call (36 MiB of copies per call for ten 4 MiB leaves).
  """
  leaves, treedef = jax.tree.flatten(tree)
  fills = lax.optimization_barrier(jnp.zeros(len(leaves), jnp.float32))

  def zeros_like(x, fill):
    zeros = jnp.zeros(x.shape, x.dtype, out_sharding=readers.explicit_spec(x))
    zeros = zeros + fill.astype(x.dtype)
    vma = tuple(sorted(axes.varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros

  return treedef.unflatten(
      [zeros_like(x, fills[i]) for i, x in enumerate(leaves)])


def _first_device(x: Any, axis_name: readers.AxisName) -> Any:
  """The first device's ``x``, on every device (a key, an int, a bool)."""
  is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(x) if is_key else x
  is_bool = data.dtype == jnp.bool_
  if is_bool:
    data = data.astype(jnp.int32)
  first = lax.axis_index(axis_name) == 0
  data = lax.psum(jnp.where(first, data, jnp.zeros_like(data)), axis_name)
  if is_bool:
    data = data.astype(jnp.bool_)
  if is_key:
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return data


def model_state_over(tree: Any, axis_name: readers.AxisName) -> Any:
  """The model state after a data-parallel loop, the same on every device.

  Floating leaves (BatchNorm statistics) are averaged over the axis; the
  others (PRNG keys, counters), which no average suits, are the first
  device's.
  """
  return jax.tree.map(
      lambda x: lax.pmean(x, axis_name) if axes.is_floating(x)
      else _first_device(x, axis_name), tree
  )
