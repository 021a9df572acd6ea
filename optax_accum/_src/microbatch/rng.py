"""One PRNG key per micro-batch (and per device), derived from the caller's.

A loss with dropout that gets the same key for every micro-batch draws the
same mask for each of them: not what the full batch sees, where every example
gets its own draw. The micro-batch loops therefore derive a key per
micro-batch from the caller's, by folding in the micro-batch's index and,
under a data-parallel axis, the device's index:

.. code-block:: python

  key = rng                                            # the caller's key
  key = jax.random.fold_in(key, lax.axis_index(axis))  # with axis_name only
  key = jax.random.fold_in(key, i)                     # micro-batch i

Keys are then distinct across micro-batches, devices and calls given
different keys, and the same given the same key: a run is reproducible and a
user can rebuild any micro-batch's key with :func:`key_for`.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src.mesh import readers


def check_rng(rng: Any) -> Any:
  """Returns ``rng`` if it is a PRNG key or None; raises naming it otherwise.

  A key is a typed key (:func:`jax.random.key`) or a raw ``uint32`` key
  (:func:`jax.random.PRNGKey`), one key, not a batch of them.
  """
  if rng is None:
    return None
  dtype = getattr(rng, "dtype", None)
  shape = jnp.shape(rng) if dtype is not None else None
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return rng
  elif dtype == jnp.uint32 and shape is not None and len(shape) == 1:
    return rng
  got = (f"{rng!r} of type {type(rng).__name__}" if dtype is None
         else f"an array of dtype {dtype} and shape {shape}")
  raise TypeError(
      f"rng must be one PRNG key, e.g. jax.random.key(0), or None, got {got}."
  )


def key_for(
    rng: jax.Array, index: Any, axis_name: readers.AxisName | None = None
) -> jax.Array:
  """The key that micro-batch ``index`` gets from ``rng`` (on this device).

  ``jax.random.fold_in(rng, index)``; with ``axis_name`` the device's index
  along the axis is folded in first:
  ``fold_in(fold_in(rng, lax.axis_index(axis_name)), index)``.

  Args:
    rng: the caller's PRNG key.
    index: the micro-batch's index in the loop, an int or an int32 scalar.
    axis_name: the data-parallel axis (or axes) the loop runs over, a manual
      axis here (inside :func:`jax.shard_map` or :func:`jax.pmap`), or None.

  Returns:
    The micro-batch's key, of the same kind as ``rng``.

  Examples:
    >>> import jax
    >>> import optax_accum as oa
    >>> from optax_accum._src.microbatch import rng as rng_lib
    >>> rng = jax.random.key(0)
    >>> k0, k1 = (rng_lib.key_for(rng, i) for i in range(2))
    >>> bool((jax.random.key_data(k0) != jax.random.key_data(k1)).any())
    True
    >>> bool((jax.random.key_data(k1)
    ...       == jax.random.key_data(jax.random.fold_in(rng, 1))).all())
    True
  """
  if axis_name is not None:
    rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
  return jax.random.fold_in(rng, index)
