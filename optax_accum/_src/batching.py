"""Splitting a batch into micro-batches, and the checks that go with it."""

from typing import Any

import jax
import jax.numpy as jnp


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
