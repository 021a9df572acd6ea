"""Splitting a batch into micro-batches, and the checks that go with it.

Each batch leaf is split along its own axis (``batch_axes``, like
:func:`jax.vmap`'s ``in_axes``), or passed whole to every micro-batch (axis
None). The split is a reshape that exposes a micro-batch axis, indexed inside
the loop: no copy of the batch is made. Two layouts:

* contiguous (the default): micro-batch ``i`` holds rows
  ``[i * b // k, (i + 1) * b // k)`` of each device's shard ``b`` of the
  batch: on one device (and on each device of a manual data axis) rows
  ``[i * B // k, (i + 1) * B // k)``; for a batch whose type shards it over
  ``D`` devices (Explicit axes), the leaf is viewed as ``(D, k, b // k)``
  blocks, and micro-batch ``i`` is the ``i``-th block of every device's
  shard, still sharded over them: no data moves;
* strided, for a batch that XLA may shard along its split axis without
  saying how (an Auto mesh axis set by :func:`jax.set_mesh` when the loop
  runs without ``axis_name``): micro-batch ``i`` holds rows ``i, i + k,
  i + 2k, ...``, so that XLA has no reason to reshard it. Token weighting
  makes the result the full batch's whatever rows go together.
"""

import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import tree_match
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import loss_signature

# For a split that leaves one row per micro-batch.
STACKED_HINT = (
    " If the batch is already stacked as (k, micro, ...), pass it unstacked,"
    " as (k * micro, ...): fn splits it into micro-batches itself."
)


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
      + (STACKED_HINT if size == num_microbatches > 1 else "")
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
  blocks: int = 1  # D: contiguous within each of D devices' shards.


def leaf_axes(batch: Any, batch_axes: Any) -> list[int | None]:
  """The split axis of each leaf of ``batch`` (non-negative), or None.

  Raises naming the leaf for an axis out of range, and if no leaf is split.
  """
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not paths_and_leaves:
    raise ValueError(
        "batch must contain at least one array, got"
        f" {loss_signature.shown(batch)}, with no leaves. " +
        loss_signature.order_hint(equinox=True))
  entries = tree_match.prefix_leaves("batch_axes", batch_axes, batch, "batch")
  if all(axis is not None and loss_signature.is_array(leaf)
         and jnp.ndim(leaf) == 0
         for (_, leaf), axis in zip(paths_and_leaves, entries)):
    raise ValueError(
        "No leaf of batch has an axis to split into micro-batches: all are"
        f" scalars, in {loss_signature.shown(batch)}. " +
        loss_signature.order_hint())
  out = []
  for (path, leaf), axis in zip(paths_and_leaves, entries):
    where = f"batch{jax.tree_util.keystr(path)}"
    if axis is not None and not loss_signature.is_array(leaf):
      raise TypeError(
          f"{where} is a {type(leaf).__name__}"
          f" ({loss_signature.shown(leaf)}), not an array to split into"
          " micro-batches. " + loss_signature.order_hint(equinox=True))
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
  spec = readers.explicit_spec(leaf)
  if spec is None or axis >= len(spec) or spec[axis] is None:
    return 1
  names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
  sizes = readers.axis_sizes(readers.mesh_of(leaf))
  return math.prod(sizes[n] for n in names)


def _auto_axes_may_shard() -> bool:
  """Whether the current mesh has an Auto axis over which XLA may shard."""
  return bool(readers.auto_axes(jax.sharding.get_abstract_mesh()))


def _split_entries(spec: Any, axis: int, ndim: int, strided: bool,
                   blocked: bool) -> list[Any]:
  """The spec entries of a leaf whose ``axis`` is split (see :func:`split`)."""
  entries = list(spec) + [None] * (ndim - len(spec))
  if blocked:
    rows = (entries[axis], None, None)
  else:
    rows = (entries[axis], None) if strided else (None, entries[axis])
  return entries[:axis] + list(rows) + entries[axis + 1 :]


def _reshape(leaf, axis, shape, strided, blocked=False):
  """Reshapes ``leaf``, keeping its Explicit sharding on the rows' axis."""
  spec = readers.explicit_spec(leaf)
  if spec is None:
    return jnp.reshape(leaf, shape)
  out = _split_entries(spec, axis, jnp.ndim(leaf), strided, blocked)
  return jnp.reshape(leaf, shape, out_sharding=P(*out))


def _merged(x: Any, axis: int) -> Any:
  """``x`` with dimensions ``axis`` and ``axis + 1`` merged into one,
  sharded as dimension ``axis`` was."""
  shape = jnp.shape(x)
  merged = shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2 :]
  spec = readers.explicit_spec(x)
  if spec is None:
    return jnp.reshape(x, merged)
  entries = list(spec) + [None] * (jnp.ndim(x) - len(spec))
  out = entries[: axis + 1] + entries[axis + 2 :]
  return jnp.reshape(x, merged, out_sharding=P(*out))


def split(
    batch: Any, batch_axes: Any, num_microbatches: int, *,
    sharded_layout_for_auto: bool = True,
    known_axes: list[int | None] | None = None,
) -> Split:
  """Splits ``batch`` into ``num_microbatches`` micro-batches (no copy).

  Args:
    batch: a pytree of arrays.
    batch_axes: an int, None, or a pytree prefix of ``batch`` of those.
    num_microbatches: the number ``k`` of micro-batches.
    sharded_layout_for_auto: whether Auto axes of the current mesh call for
      the strided layout (without ``axis_name``: XLA may shard the batch
      over them).
    known_axes: the leaves' split axes, if :func:`leaf_axes` gave them
      already (``batch_axes`` is then not read).

  Returns:
    A :class:`Split`; :func:`take` gives micro-batch ``i``.
  """
  axes = leaf_axes(batch, batch_axes) if known_axes is None else known_axes
  size = split_size(batch, axes)
  check_divisible(size, num_microbatches)
  leaves, treedef = jax.tree.flatten(batch)
  shards = math.lcm(
      *(_shards(x, a) for x, a in zip(leaves, axes) if a is not None))
  blocked = shards > 1
  strided = not blocked and sharded_layout_for_auto and _auto_axes_may_shard()
  k, rows = num_microbatches, size // num_microbatches
  if blocked and rows % shards:
    raise ValueError(
        f"The batch, sharded over {shards} devices along its batch axis,"
        f" splits into num_microbatches={k} micro-batches of {rows} rows each,"
        f" which must be divisible by {shards}: pick a batch size divisible"
        f" by {k} * {shards}." + (STACKED_HINT if rows == 1 < k else "")
    )
  out, index_axes = [], []
  for leaf, axis in zip(leaves, axes):
    if axis is None:
      out.append(leaf)
      index_axes.append(None)
      continue
    shape = jnp.shape(leaf)
    if blocked:
      split_shape = (shards, k, rows // shards)
    else:
      split_shape = (rows, k) if strided else (k, rows)
    out.append(_reshape(leaf, axis, shape[:axis] + split_shape
                        + shape[axis + 1 :], strided, blocked))
    index_axes.append(axis + 1 if strided or blocked else axis)
  return Split(out, index_axes, treedef, strided, rows,
               shards if blocked else 1)


def merge_rows(stacked: Any, batch_split: Split) -> Any:
  """Per-micro-batch rows ``(k, rows, ...)`` back in the batch's row order."""
  if batch_split.blocks > 1:
    d = batch_split.blocks
    k, rows = jnp.shape(stacked)[:2]
    rest = jnp.shape(stacked)[2:]
    spec = readers.explicit_spec(stacked)
    entries = (list(spec) + [None] * (jnp.ndim(stacked) - len(spec))
               if spec is not None else None)

    def reshape(x, shape, *lead):
      if entries is None:
        return jnp.reshape(x, shape)
      return jnp.reshape(x, shape, out_sharding=P(*lead, *entries[2:]))

    blocks = reshape(stacked, (k, d, rows // d) + rest,
                     None, None if entries is None else entries[1], None)
    blocks = jnp.swapaxes(blocks, 0, 1)
    return reshape(blocks, (-1,) + rest,
                   None if entries is None else entries[1])
  if batch_split.strided:
    stacked = jnp.swapaxes(stacked, 0, 1)
  return _merged_rows(stacked)


def _merged_rows(stacked: Any) -> Any:
  """``(k, rows, ...)`` as ``(k * rows, ...)``, unblocked.

  Unblocked rows may still be typed over Explicit data axes of size 1 (a
  (1, 8) mesh), which JAX's reshape does not merge without an
  ``out_sharding``: the merged axis takes both axes' names, in order.
  """
  merged = (-1,) + jnp.shape(stacked)[2:]
  spec = readers.explicit_spec(stacked)
  if spec is None:
    return jnp.reshape(stacked, merged)
  entries = list(spec) + [None] * (jnp.ndim(stacked) - len(spec))
  names = tuple(n for e in entries[:2] if e is not None
                for n in ((e,) if isinstance(e, str) else e))
  entry = None if not names else names[0] if len(names) == 1 else names
  return jnp.reshape(stacked, merged, out_sharding=P(entry, *entries[2:]))


def split_rows(x: Any, batch_split: Split) -> Any:
  """The batch's rows ``(B, ...)`` as per-micro-batch rows ``(k, rows, ...)``.

  The inverse of :func:`merge_rows`.
  """
  k, rest = len_microbatches(batch_split), jnp.shape(x)[1:]
  if batch_split.blocks > 1:
    d = batch_split.blocks
    spec = readers.explicit_spec(x)
    entry = None if spec is None or not len(spec) else spec[0]
    tail = [] if spec is None else list(spec[1:]) + [None] * (
        len(rest) - len(spec[1:]))

    def reshape(y, shape, *lead):
      if spec is None:
        return jnp.reshape(y, shape)
      return jnp.reshape(y, shape, out_sharding=P(*lead, *tail))

    blocks = reshape(x, (d, k, -1) + rest, entry, None, None)
    return reshape(jnp.swapaxes(blocks, 0, 1), (k, -1) + rest, None, entry)
  if batch_split.strided:
    return jnp.swapaxes(jnp.reshape(x, (-1, k) + rest), 0, 1)
  spec = readers.explicit_spec(x)
  if spec is None:
    return jnp.reshape(x, (k, -1) + rest)
  # Rows typed over data axes of size 1 (a (1, 8) mesh): the names stay on
  # the rows, so that lax.scan takes the micro-batches along a replicated
  # axis.
  entries = list(spec) + [None] * (jnp.ndim(x) - len(spec))
  return jnp.reshape(x, (k, -1) + rest, out_sharding=P(None, *entries))


def len_microbatches(batch_split: Split) -> int:
  """The number ``k`` of micro-batches of a :class:`Split`."""
  leaf, axis = next((x, a) for x, a in zip(batch_split.leaves,
                                           batch_split.axes) if a is not None)
  return jnp.shape(leaf)[axis]


def take(batch_split: Split, index: Any) -> Any:
  """Micro-batch ``index`` of a :class:`Split` (a traced index is fine)."""
  leaves = []
  for leaf, axis in zip(batch_split.leaves, batch_split.axes):
    if axis is not None:
      leaf = lax.dynamic_index_in_dim(leaf, index, axis, keepdims=False)
      if batch_split.blocks > 1:
        leaf = _merged(leaf, axis - 1)
    leaves.append(leaf)
  return batch_split.treedef.unflatten(leaves)
