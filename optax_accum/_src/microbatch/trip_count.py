"""The micro-batch loop's trip count: all ``k``, or only the first ``n``.

:func:`loop.loop` builds one trip's step; this module runs it: a
``lax.scan`` over the ``k`` micro-batches, or, with
``num_real_microbatches=n`` (:func:`check_num_real`), an XLA while loop of
``n`` trips, a traced count that needs no recompilation
(:func:`run_microbatches`); where :mod:`borrowing` applies, a while loop of
``k`` trips, none if no micro-batch has tokens (:func:`run_borrowing`).
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import conditional_loops
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers


def check_num_real(num_real: Any, num_microbatches: int) -> jax.Array | None:
  """``num_real_microbatches`` as an int32 scalar in ``[1, k]``, or None.

  A concrete value outside the range raises; a traced one is clamped.
  """
  if num_real is None:
    return None
  is_int = isinstance(num_real, int) and not isinstance(num_real, bool)
  is_int_scalar = (hasattr(num_real, "dtype") and jnp.ndim(num_real) == 0
                   and jnp.issubdtype(num_real.dtype, jnp.integer))
  if not (is_int or is_int_scalar):
    raise TypeError(
        "num_real_microbatches must be an integer scalar, got"
        f" {num_real!r}."
    )
  if not isinstance(num_real, jax.core.Tracer):
    if not 1 <= int(num_real) <= num_microbatches:
      raise ValueError(
          f"num_real_microbatches={int(num_real)} must be in [1,"
          f" num_microbatches={num_microbatches}]."
      )
  return jnp.clip(jnp.asarray(num_real, jnp.int32), 1, num_microbatches)


def run_borrowing(step, init, runs, num_microbatches, num_real):
  """The loop of :mod:`borrowing`: it runs no micro-batch at all if every
  count is zero (their zero seeds would meet 0/0); ``runs`` says
  (``borrowing.plan``: a bad count runs it, to reach the sums).

  It outputs nothing per micro-batch (borrowing applies only where nothing
  is stacked): the values' dtype and the (leafless) stacked aux are read
  off the one trace of ``step``.
  """
  seen = []

  def body(carry, index):
    carry, (value, stacked) = step(carry, index)
    if jax.tree.leaves(stacked):
      raise AssertionError("borrowing stacks nothing per micro-batch.")
    seen.append((value.dtype, stacked))
    return carry

  if num_real is None:
    carry = conditional_loops.trips_if(runs, body, num_microbatches,
                                       init)
  else:  # a traced count: no reverse mode, as run_microbatches's.
    carry = conditional_loops.trips(
        body, jnp.where(runs, 0, num_real), num_real, init)
  dtype, stacked = seen[-1]
  return carry, (jax.ShapeDtypeStruct((num_microbatches,), dtype), stacked)


def run_microbatches(step, init, num_microbatches, num_real):
  """``lax.scan(step, init, arange(k))``, or only the first ``num_real``.

  With ``num_real`` the loop is a ``lax.fori_loop`` with that traced trip
  count (an XLA while loop: the micro-batches past it are not computed, and
  another count needs no recompilation); the outputs of the skipped
  micro-batches are zeros.
  """
  indices = jnp.arange(num_microbatches)
  if num_real is None:
    return lax.scan(step, init, indices)
  def zeros(shape):
    spec = readers.explicit_spec(shape)
    buffer = jnp.zeros(
        (num_microbatches,) + shape.shape, shape.dtype,
        out_sharding=None if spec is None else P(None, *spec))
    # Under shard_map the outputs may vary over the axis: so must the carry.
    vma = tuple(sorted(axes.varying_axes(shape)))
    return lax.pcast(buffer, vma, to="varying") if vma else buffer

  stacked = jax.tree.map(
      zeros, jax.eval_shape(lambda: step(init, indices[0])[1]))

  def body(index, state):
    carry, stacked = state
    carry, out = step(carry, index)
    return carry, jax.tree.map(
        lambda buf, x: lax.dynamic_update_index_in_dim(buf, x, index, 0),
        stacked, out)

  return lax.fori_loop(0, num_real, body, (init, stacked))
