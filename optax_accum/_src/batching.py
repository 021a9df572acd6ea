"""Splitting a batch into micro-batches, and the checks that go with it.

Each batch leaf is split along its own axis (``batch_axes``, like
:func:`jax.vmap`'s ``in_axes``), or passed whole to every micro-batch (axis
None). The split is a reshape that exposes a micro-batch axis, indexed inside
the loop: no copy of the batch is made. Two layouts:

* contiguous (the default): micro-batch ``i`` holds rows
  ``[i * B // k, (i + 1) * B // k)``;
* strided, for a batch sharded along its split axis (an Explicit sharding in
  its type, or an Auto mesh axis set by :func:`jax.set_mesh` when the loop
  runs without ``axis_name``): micro-batch ``i`` holds rows ``i, i + k,
  i + 2k, ...``. Every device then keeps its own rows, and each micro-batch
  takes ``1/k`` of every device's shard: no resharding of the batch. Token
  weighting makes the result the full batch's whatever rows go together.
"""

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optax_accum._src import sharding
from optax_accum._src import validation


def batch_size(batch: Any) -> int:
  """The leading size shared by every leaf of ``batch``, or a clear error."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError(
        "batch must contain at least one array, got an empty tree."
    )
  sizes = {}
  for path, leaf in leaves:
    if jnp.ndim(leaf) == 0:
      raise ValueError(
          f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf"
          " needs a leading batch axis to split into micro-batches."
      )
    sizes[jax.tree_util.keystr(path)] = jnp.shape(leaf)[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        f"batch leaves must share a leading batch size, got sizes {sizes}."
    )
  return next(iter(sizes.values()))


def check_divisible(size: int, num_microbatches: int, devices: int = 1) -> None:
  """Raises unless ``size`` splits into ``devices * num_microbatches`` parts."""
  if size % (devices * num_microbatches) == 0:
    return
  if devices == 1:
    raise ValueError(
        f"The batch size {size} (leading axis of every batch leaf) must be"
        f" divisible by num_microbatches={num_microbatches}."
    )
  raise ValueError(
      f"The batch size {size} must be divisible by num_microbatches * the"
      f" data axis size = {num_microbatches} * {devices}: each device splits"
      " its shard of the batch into micro-batches."
  )


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
  """Reshapes each leaf ``(B, ...)`` into ``(num_microbatches, B // k, ...)``.

  Micro-batch ``i`` holds rows ``[i * B // k, (i + 1) * B // k)``. The reshape
  is free in XLA: no copy of the batch is made.

  Args:
    batch: a pytree of arrays sharing a leading batch axis.
    num_microbatches: the number ``k`` of micro-batches.

  Returns:
    The batch with a new leading micro-batch axis.
  """
  size = batch_size(batch)
  check_divisible(size, num_microbatches)
  rows = size // num_microbatches
  return jax.tree.map(
      lambda x: jnp.reshape(x, (num_microbatches, rows) + jnp.shape(x)[1:]),
      batch,
  )


def check_batch_axes(batch_axes: Any) -> Any:
  """Returns ``batch_axes`` if its leaves are ints or None; raises otherwise."""
  for leaf in jax.tree.leaves(batch_axes, is_leaf=lambda x: x is None):
    if leaf is not None and (
        isinstance(leaf, bool) or not isinstance(leaf, int)):
      raise TypeError(
          "batch_axes must be an int, None, or a pytree prefix of batch of"
          f" ints and Nones (like jax.vmap's in_axes), got {leaf!r} in"
          f" {batch_axes!r}."
      )
  return batch_axes


class Split(NamedTuple):
  """A batch split into micro-batches, ready to be indexed by :func:`take`."""

  leaves: list[Any]  # each leaf with a micro-batch axis exposed, or whole.
  axes: list[int | None]  # the micro-batch axis of each leaf, or None.
  treedef: Any  # the batch's structure.
  strided: bool  # micro-batch i holds rows i, i + k, ...: not contiguous.
  rows: int  # rows per micro-batch.


def leaf_axes(batch: Any, batch_axes: Any) -> list[int | None]:
  """The split axis of each leaf of ``batch`` (non-negative), or None.

  Raises naming the leaf for an axis out of range, and if no leaf is split.
  """
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not paths_and_leaves:
    raise ValueError(
        "batch must contain at least one array, got an empty tree.")
  entries = validation.prefix_leaves("batch_axes", batch_axes, batch, "batch")
  out = []
  for (path, leaf), axis in zip(paths_and_leaves, entries):
    where = f"batch{jax.tree_util.keystr(path)}"
    ndim = jnp.ndim(leaf)
    if axis is None:
      out.append(None)
    elif ndim == 0:
      raise ValueError(
          f"{where} is a scalar but batch_axes gives it axis {axis}; pass"
          " batch_axes=None for it (e.g. batch_axes={..., 'name': None}) to"
          " hand it whole to every micro-batch."
      )
    elif not -ndim <= axis < ndim:
      raise ValueError(
          f"batch_axes gives {where} axis {axis}, out of range for its shape"
          f" {jnp.shape(leaf)}."
      )
    else:
      out.append(axis % ndim)
  if all(axis is None for axis in out):
    raise ValueError(
        f"batch_axes={batch_axes!r} splits no leaf of batch: give at least one"
        " leaf an axis to split into micro-batches."
    )
  return out


def split_size(batch: Any, axes: list[int | None]) -> int:
  """The size shared by the split axes of ``batch``'s leaves."""
  sizes = {}
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(batch)
  for (path, leaf), axis in zip(paths_and_leaves, axes):
    if axis is not None:
      sizes[f"batch{jax.tree_util.keystr(path)}"] = jnp.shape(leaf)[axis]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        "batch leaves must share the size of their batch axis (batch_axes),"
        f" got sizes {sizes}."
    )
  return next(iter(sizes.values()))


def _shards(leaf: Any, axis: int) -> int:
  """Over how many devices an Explicit sharding splits ``leaf``'s ``axis``."""
  spec = sharding.explicit_spec(leaf)
  if spec is None or axis >= len(spec) or spec[axis] is None:
    return 1
  names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
  sizes = dict(jax.typeof(leaf).sharding.mesh.shape)
  return math.prod(sizes[n] for n in names)


def _auto_axes_may_shard() -> bool:
  """Whether the current mesh has an Auto axis over which XLA may shard."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return False
  manual = set(getattr(mesh, "manual_axes", ()))
  return any(
      t == AxisType.Auto and size > 1 and name not in manual
      for name, size, t in zip(mesh.axis_names, mesh.axis_sizes,
                               mesh.axis_types)
  )


def _reshape(leaf, axis, shape, strided):
  """Reshapes ``leaf``, keeping its Explicit sharding on the rows' axis."""
  spec = sharding.explicit_spec(leaf)
  if spec is None:
    return jnp.reshape(leaf, shape)
  entries = list(spec) + [None] * (jnp.ndim(leaf) - len(spec))
  rows = (entries[axis], None) if strided else (None, entries[axis])
  out = P(*entries[:axis], *rows, *entries[axis + 1 :])
  return jnp.reshape(leaf, shape, out_sharding=out)


def split(
    batch: Any, batch_axes: Any, num_microbatches: int, *,
    sharded_layout_for_auto: bool = True,
) -> Split:
  """Splits ``batch`` into ``num_microbatches`` micro-batches (no copy).

  Args:
    batch: a pytree of arrays.
    batch_axes: an int, None, or a pytree prefix of ``batch`` of those.
    num_microbatches: the number ``k`` of micro-batches.
    sharded_layout_for_auto: whether Auto axes of the current mesh call for
      the strided layout (without ``axis_name``: XLA may shard the batch
      over them).

  Returns:
    A :class:`Split`; :func:`take` gives micro-batch ``i``.
  """
  axes = leaf_axes(batch, batch_axes)
  size = split_size(batch, axes)
  check_divisible(size, num_microbatches)
  leaves, treedef = jax.tree.flatten(batch)
  shards = math.lcm(
      *(_shards(x, a) for x, a in zip(leaves, axes) if a is not None))
  strided = shards > 1 or (sharded_layout_for_auto and _auto_axes_may_shard())
  k, rows = num_microbatches, size // num_microbatches
  if strided and rows % shards:
    raise ValueError(
        f"The batch, sharded over {shards} devices along its batch axis,"
        f" splits into num_microbatches={k} micro-batches of {rows} rows each,"
        f" which must be divisible by {shards}: pick a batch size divisible"
        f" by {k} * {shards}."
    )
  out, index_axes = [], []
  for leaf, axis in zip(leaves, axes):
    if axis is None:
      out.append(leaf)
      index_axes.append(None)
      continue
    shape = jnp.shape(leaf)
    split_shape = (rows, k) if strided else (k, rows)
    out.append(_reshape(leaf, axis, shape[:axis] + split_shape
                        + shape[axis + 1 :], strided))
    index_axes.append(axis + 1 if strided else axis)
  return Split(out, index_axes, treedef, strided, rows)


def merge_rows(stacked: Any, strided: bool) -> Any:
  """Per-micro-batch rows ``(k, rows, ...)`` back in the batch's row order."""
  if strided:
    stacked = jnp.swapaxes(stacked, 0, 1)
  return jnp.reshape(stacked, (-1,) + jnp.shape(stacked)[2:])


def split_rows(x: Any, num_microbatches: int, strided: bool) -> Any:
  """The batch's rows ``(B, ...)`` as per-micro-batch rows ``(k, rows, ...)``.

  The inverse of :func:`merge_rows`.
  """
  k, rest = num_microbatches, jnp.shape(x)[1:]
  if strided:
    return jnp.swapaxes(jnp.reshape(x, (-1, k) + rest), 0, 1)
  return jnp.reshape(x, (k, -1) + rest)


def take(batch_split: Split, index: Any) -> Any:
  """Micro-batch ``index`` of a :class:`Split` (a traced index is fine)."""
  leaves = [
      leaf if axis is None
      else lax.dynamic_index_in_dim(leaf, index, axis, keepdims=False)
      for leaf, axis in zip(batch_split.leaves, batch_split.axes)
  ]
  return batch_split.treedef.unflatten(leaves)
