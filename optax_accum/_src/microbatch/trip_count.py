"""The micro-batch loop's trip count: all ``k``, or only the first ``n``.

:func:`loop.loop` builds one trip's step; this module runs it: a
``lax.scan`` over the ``k`` micro-batches, or, with
``num_real_microbatches=n`` (:func:`check_num_real`), an XLA while loop of
``n`` trips, a traced count that needs no recompilation
(:func:`run_microbatches`); where :mod:`borrowing` applies, a while loop of
``k`` trips, none if no micro-batch has tokens (:func:`run_borrowing`).
Each may run its last trip after the loop (:func:`peel`).
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import conditional_loops
from optax_accum._src import names
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers


def peeled(asked: bool, num_microbatches: int, reduces: bool) -> bool:
  """Whether the last micro-batch runs after the loop (SPEC 13).

  Inside the loop, the one reduction after it waits for the whole last
  backward pass; after it, each leaf's reduction may start as soon as that
  backward has produced the leaf's last gradient (the last layers' first),
  and XLA's latency-hiding scheduler may run it beside the rest of the
  backward (Megatron-LM's ``overlap_grad_reduce``). Where ``asked``
  (``overlap_reduction=True``: it costs compile time, and memory with FSDP,
  ``docs/performance.md``), where the call reduces gradients over devices
  only after the loop (``reduces``), and for k > 1 (one micro-batch has no
  loop).
  """
  return asked and reduces and num_microbatches > 1


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


def peel(loop, trip, step, state, stop, last_step=None):
  """``loop(step, state, stop)``: the trips ``[0, stop)`` of ``step``, as
  ``(carry, outputs)``; with ``last_step`` (the step of the last trip, from
  the loop's carry) the last trip runs after the loop (:func:`peeled`), as
  ``trip(last_step(carry), (carry, outputs), stop - 1)``.

  The one form of the three runners below: each gives its loop and its
  trip (which writes the trip's outputs beside the loop's).
  """
  if last_step is None:
    return loop(step, state, stop)
  state = loop(step, state, stop - 1)
  last = jnp.int32(stop - 1) if isinstance(stop, int) else stop - 1
  with jax.named_scope(names.PEELED_SCOPE):
    return trip(last_step(state[0]), state, last)


def run_borrowing(step, init, runs, num_microbatches, num_real,
                  last_step=None):
  """The loop of :mod:`borrowing`: a ``lax.scan`` of every micro-batch,
  whatever ``runs`` says (``borrowing.plan``: whether any micro-batch has
  tokens, or a bad count that must reach the sums). Where none has tokens,
  their zero seeds meet 0/0 and the sums may be NaN, with a token count of
  zero: :func:`grad_reduction.mean_by_rule` makes the mean of no tokens
  zero, after the reduction (a select before it, in the loop, had XLA's GPU
  compiler fuse the leaves' selects into one and start no reduction before
  the last micro-batch's). Differentiated, no micro-batch runs there
  (:func:`conditional_loops.scan_if`), so that no NaN reaches a derivative.
  With a traced ``num_real``, a while loop that runs none there.

  With ``last_step`` the last micro-batch runs after the loop
  (:func:`peel`).

  It outputs nothing per micro-batch (borrowing applies only where nothing
  is stacked): the values' dtype and the (leafless) stacked aux are read
  off the one trace of ``step``.
  """
  seen = []

  def body_of(step):
    def body(carry, index):
      carry, (value, stacked) = step(carry, index)
      if jax.tree.leaves(stacked):
        raise AssertionError("borrowing stacks nothing per micro-batch.")
      seen.append((value.dtype, stacked))
      return carry
    return body

  def loop(step, carry, stop):
    if num_real is None:
      return conditional_loops.scan_if(runs, body_of(step), stop, carry), None
    # A traced count: no reverse mode, as run_microbatches's.
    return conditional_loops.trips(body_of(step), jnp.where(runs, 0, stop),
                                   stop, carry), None

  def trip(step, state, index):
    return body_of(step)(state[0], index), None

  stop = num_microbatches if num_real is None else num_real
  carry, _ = peel(loop, trip, step, init, stop, last_step)
  dtype, stacked = seen[-1]
  return carry, (jax.ShapeDtypeStruct((num_microbatches,), dtype), stacked)


def run_microbatches(step, init, num_microbatches, num_real,
                     last_step=None):
  """``lax.scan(step, init, arange(k))``, or only the first ``num_real``.

  With ``num_real`` the loop is a ``lax.fori_loop`` with that traced trip
  count (an XLA while loop: the micro-batches past it are not computed, and
  another count needs no recompilation); the outputs of the skipped
  micro-batches are zeros. With ``last_step`` the last micro-batch (the
  ``num_real``-th) runs after the loop (:func:`peel`).
  """
  indices = jnp.arange(num_microbatches)
  if num_real is None:
    def scan(step, carry, stop):
      return lax.scan(step, carry,
                      indices if stop == num_microbatches else indices[:stop])

    def appended(step, state, index):
      carry, last = step(state[0], index)
      return carry, jax.tree.map(
          lambda xs, x: jnp.concatenate([xs, x[None]]), state[1], last)

    return peel(scan, appended, step, init, num_microbatches, last_step)

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

  def written(step, state, index):
    carry, out = step(state[0], index)
    return carry, jax.tree.map(
        lambda buf, x: lax.dynamic_update_index_in_dim(buf, x, index, 0),
        state[1], out)

  def fori(step, state, stop):
    return lax.fori_loop(0, stop, lambda i, s: written(step, s, i), state)

  return peel(fori, written, step, (init, stacked), num_real, last_step)
