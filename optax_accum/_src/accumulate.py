"""Gradient accumulation as an optax transformation: one micro-batch per call."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import distributed
from optax_accum._src import validation


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`: the running sums and the wrapped state.

  ``grad_sum`` is the current cycle's running sum. When ``micro_step == 0``
  (a cycle has just been emitted) it still holds the finished cycle's sum,
  which the next call discards instead of adding to: the reset is lazy so that
  a non-emitting micro-step stays one in-place pass over the sum.
  """

  micro_step: jax.Array  # shape=(), dtype=jnp.int32.
  count: jax.Array  # shape=(), dtype=jnp.int32.
  grad_sum: optax.Updates  # like params, dtype=accumulator_dtype.
  token_count: jax.Array  # shape=(), dtype=jnp.float32.
  inner_state: optax.OptState
  emitted: jax.Array  # shape=(), dtype=jnp.bool_.
  nonfinite_count: jax.Array  # shape=(), dtype=jnp.int32.


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array],
    *,
    loss_reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | tuple[str, ...] | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates micro-batch gradients and updates once per cycle.

  Each call takes the gradient of one micro-batch. With
  ``loss_reduction="mean"`` the gradient is of a loss averaged over
  ``num_tokens`` items, so the call adds ``num_tokens * grads`` to a running
  sum; with ``"sum"`` it adds ``grads`` as they are. In both cases it adds
  ``num_tokens`` to a running token count. On the ``every_k``-th call of a
  cycle the transformation hands ``inner`` the exact token-weighted mean

  .. math::
    \bar g = \frac{\sum_i n_i \, g_i}{\sum_i n_i}

  (the gradient of the full batch's per-token mean loss, however unevenly the
  tokens fall into micro-batches), returns ``inner``'s updates and starts a new
  cycle. Every other call returns zero updates. The emit/skip decision is a
  :func:`jax.lax.cond`: ``inner`` runs once per optimizer update, so its step
  count, learning-rate schedule, weight decay and clipping see one step per
  update, applied to the accumulated gradient.

  The emitting call resets the token count; the sum is reset lazily, by the
  call that starts the next cycle (see :class:`AccumulateState`), which keeps
  a non-emitting call to one fused in-place pass over the sum.

  The sum is kept in ``accumulator_dtype`` whatever the gradients' dtype; the
  mean handed to ``inner`` has the gradients' dtype. A cycle with no tokens
  (every micro-step dropped, say) emits zero updates and leaves ``inner``'s
  state untouched. With ``axis_name``, gradients and token counts stay local to
  each device through the cycle and are summed over the axis once, inside the
  emitting branch; use it inside :func:`jax.shard_map` or :func:`jax.pmap`,
  with :func:`optax_accum.state_partition_specs` for the state's specs.

  Args:
    inner: the optimizer to run on the accumulated gradient.
    every_k: micro-steps per optimizer update: a positive int, or a callable
      mapping the number of updates emitted so far (``state.count``) to a cycle
      length (for a batch-size warm-up). Lengths below one count as one.
    loss_reduction: how each incoming gradient's loss was reduced over its
      ``num_tokens`` items: ``"mean"`` or ``"sum"``.
    accumulator_dtype: floating dtype of the running sum.
    axis_name: data-parallel axis (or axes) to sum over on emit, or None.
    skip_nonfinite: if True, a micro-step whose gradient (or ``num_tokens``)
      has a NaN or Inf adds nothing, neither gradient nor tokens, but still
      counts as a micro-step of the cycle; ``state.nonfinite_count`` counts
      them.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose ``update`` takes
    ``(grads, state, params=None, *, num_tokens=None, **extra_args)``;
    ``num_tokens=None`` counts as one and ``extra_args`` go on to ``inner``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> params = {'w': jnp.zeros(2)}
    >>> tx = oa.accumulate(optax.sgd(1.0), every_k=2)
    >>> state = tx.init(params)
    >>> # Micro-batch 1: mean loss over 1 token; micro-batch 2: over 3 tokens.
    >>> g1, g2 = {'w': jnp.array([4.0, 0.0])}, {'w': jnp.array([0.0, 4.0])}
    >>> updates, state = tx.update(g1, state, params, num_tokens=1)
    >>> updates['w'], oa.has_updated(state)
    (Array([0., 0.], dtype=float32), Array(False, dtype=bool))
    >>> updates, state = tx.update(g2, state, params, num_tokens=3)
    >>> updates['w'], oa.has_updated(state)  # -(1*g1 + 3*g2) / 4
    (Array([-1., -3.], dtype=float32), Array(True, dtype=bool))
  """
  every_k = validation.check_every_k(every_k)
  loss_reduction = validation.check_loss_reduction(loss_reduction)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  axis_name = validation.check_axis_name(axis_name)
  skip_nonfinite = validation.check_bool("skip_nonfinite", skip_nonfinite)
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        "inner must be an optax.GradientTransformation, got"
        f" {type(inner).__name__}."
    )
  inner = optax.with_extra_args_support(inner)
  # With an axis, the running sums are this device's partial sums; a leading
  # slot axis of size one lets shard_map lay them out one slot per device
  # (scalars included), so that no device's partial sum can be dropped.
  slot_shape = () if axis_name is None else (1,)

  def partial_zeros(shape, dtype):
    if axis_name is None:
      return jnp.zeros(shape, dtype)
    # One slot per device of the current mesh, or this device's one slot.
    return distributed.partial_zeros(shape, dtype, axis_name)

  def init_fn(params):
    grad_sum = jax.tree.map(
        lambda p: partial_zeros(jnp.shape(p), accumulator_dtype), params
    )
    return AccumulateState(
        micro_step=jnp.zeros([], jnp.int32),
        count=jnp.zeros([], jnp.int32),
        grad_sum=grad_sum,
        token_count=partial_zeros((), jnp.float32),
        inner_state=inner.init(params),
        emitted=jnp.zeros([], jnp.bool_),
        nonfinite_count=partial_zeros((), jnp.int32),
    )

  def cycle_length(count):
    if callable(every_k):
      length = jnp.asarray(every_k(count))
      if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
        raise TypeError(
            "every_k(count) must return an integer scalar, got"
            f" {length.dtype}{list(length.shape)}."
        )
      return jnp.maximum(length.astype(jnp.int32), 1)
    return jnp.asarray(every_k, jnp.int32)

  def update_fn(updates, state, params=None, *, num_tokens=None, **extra_args):
    local_sum = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(jnp.shape(s)[len(slot_shape):], s.dtype),
        state.grad_sum,
    )
    validation.check_same_structure(
        "updates", updates, local_sum, "the params the state was built for"
    )
    tokens = validation.as_token_count("num_tokens", num_tokens)
    if skip_nonfinite:
      finite = jnp.isfinite(tokens)
      for g in jax.tree.leaves(updates):
        finite &= jnp.all(jnp.isfinite(g))
    else:
      finite = jnp.bool_(True)
    if loss_reduction == "mean":
      weight = tokens
      # A mean over zero tokens is often 0/0: its gradient must add nothing.
      keep = finite & (tokens != 0)
    else:
      weight = jnp.float32(1)
      keep = finite
    guarded = skip_nonfinite or loss_reduction == "mean"

    # The reset is lazy: the call that starts a cycle adds to zeros instead of
    # to the finished cycle's sum. Zeroing the sum inside the emitting branch
    # would make it an output of the conditional, which XLA cannot write in
    # place: it then copies every accumulator (and, on CPU, inner-state)
    # buffer on every micro-step. This way a non-emitting call is one fused
    # in-place pass over the sum, and the conditional only reads it.
    cycle_start = state.micro_step == 0

    def add_leaf(acc, g):
      acc = jnp.where(cycle_start, jnp.zeros([], acc.dtype), acc)
      term = weight.astype(acc.dtype) * g.astype(acc.dtype)
      if guarded:
        term = jnp.where(keep, term, jnp.zeros([], term.dtype))
      return acc + term.reshape(acc.shape)

    grad_sum = jax.tree.map(add_leaf, state.grad_sum, updates)
    token_count = state.token_count + jnp.where(finite, tokens, 0.0)
    micro_step = optax.safe_increment(state.micro_step)
    emit = micro_step >= cycle_length(state.count)

    inner_updates_shape = jax.eval_shape(
        lambda s: inner.update(
            distributed.like_summed(updates, axis_name), s, params,
            **extra_args
        )[0],
        state.inner_state,
    )

    def no_updates():
      return distributed.zeros_like_partials(inner_updates_shape)

    def run_inner(grad_sum, token_count, inner_state):
      safe_count = jnp.where(token_count > 0, token_count, 1.0)
      mean = jax.tree.map(
          lambda s, g: (s / safe_count.astype(s.dtype)).astype(g.dtype),
          grad_sum,
          updates,
      )
      new_updates, new_state = inner.update(
          mean, inner_state, params, **extra_args
      )
      return new_updates, optax.tree.cast_like(new_state, inner_state)

    def skip_inner(grad_sum, token_count, inner_state):
      del grad_sum, token_count
      return no_updates(), inner_state

    if axis_name is None:
      updated = emit & (token_count > 0)
      new_updates, inner_state = lax.cond(
          updated, run_inner, skip_inner, grad_sum, token_count,
          state.inner_state,
      )
    else:
      # The sums over devices happen only in the emitting branch: one
      # reduction per optimizer update.
      def emit_branch(grad_sum, token_count, inner_state):
        grad_sum, token_count = distributed.sum_partials(
            (grad_sum, token_count), axis_name
        )
        token_count = token_count.reshape(())
        has_tokens = token_count > 0
        new_updates, inner_state = lax.cond(
            has_tokens, run_inner, skip_inner, grad_sum, token_count,
            inner_state,
        )
        return new_updates, inner_state, has_tokens

      def skip_branch(grad_sum, token_count, inner_state):
        del grad_sum, token_count
        return no_updates(), inner_state, jnp.bool_(False)

      new_updates, inner_state, updated = lax.cond(
          emit, emit_branch, skip_branch, grad_sum, token_count,
          state.inner_state,
      )
    new_state = AccumulateState(
        micro_step=jnp.where(emit, 0, micro_step),
        count=jnp.where(updated, optax.safe_increment(state.count), state.count),
        grad_sum=grad_sum,
        token_count=jnp.where(emit, jnp.zeros_like(token_count), token_count),
        inner_state=inner_state,
        emitted=updated,
        nonfinite_count=jnp.where(
            finite,
            state.nonfinite_count,
            optax.safe_increment(state.nonfinite_count),
        ),
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
