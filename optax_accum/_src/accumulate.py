"""Gradient accumulation, an optax transformation: one micro-batch per call."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import emitting
from optax_accum._src import grad_reduction as grad_reduction_lib
from optax_accum._src import incoming_grads
from optax_accum._src import noise_scale
from optax_accum._src import partial_sums
from optax_accum._src import token_weighting
from optax_accum._src import validation


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`: the running sums and the wrapped state.

  With ``axis_name``, the fields marked *per device* hold each device's own
  partial value behind a leading slot axis of one slot per device (see
  :func:`optax_accum.state_partition_specs`); they are summed over the axis
  once per cycle, when it emits.

  Attributes:
    micro_step: micro-steps taken in the current cycle; 0 right after an emit.
    count: optimizer updates emitted so far (cycles that had tokens).
    grad_sum: the current cycle's running sum of token-weighted gradients,
      shaped like the parameters, in ``accumulator_dtype``; per device. The
      reset is lazy: right after an emit (``micro_step == 0``) it still holds
      the finished cycle's sum, which the next call discards instead of
      adding to (see ``_add_to_sum`` in this module for why). A leaf that
      ``grad_reduction`` reduces by "max" holds the running maximum (from
      ``-inf``), one by "last" the last kept gradient.
    token_count: the current cycle's running token count, float32; per
      device.
    inner_state: the state of the wrapped optimizer, advanced once per emit.
    emitted: whether the call that produced this state emitted an update
      (read it with :func:`optax_accum.has_updated`).
    nonfinite_count: micro-steps dropped by ``skip_nonfinite`` (a non-finite
      gradient, or a ``num_tokens`` that is NaN, infinite or negative) since
      ``init``; per device. A micro-step with zero tokens is not dropped (it
      adds nothing anyway): its NaN gradient, often a 0/0 mean, is not
      counted.
    skipped_count: micro-steps dropped by ``should_skip`` since ``init``; per
      device. A micro-step that both rules drop is counted by both.
  """

  micro_step: jax.Array  # shape=(), dtype=jnp.int32.
  count: jax.Array  # shape=(), dtype=jnp.int32.
  grad_sum: optax.Updates  # like params, dtype=accumulator_dtype.
  token_count: jax.Array  # shape=() or (slots,), dtype=jnp.float32.
  inner_state: optax.OptState
  emitted: jax.Array  # shape=(), dtype=jnp.bool_.
  nonfinite_count: jax.Array  # shape=() or (slots,), dtype=jnp.int32.
  skipped_count: jax.Array  # shape=() or (slots,), dtype=jnp.int32.
  stats_sums: noise_scale.StatsSums | None  # float32 scalars or (slots,).
  stats: noise_scale.GradStats | None  # float32 scalars.


# The fields of AccumulateState that hold per-device scalars under axis_name.
PER_DEVICE_COUNTS = (
    "token_count", "nonfinite_count", "skipped_count", "stats_sums"
)


class _Drops(NamedTuple):
  """Why a micro-step adds nothing."""

  nonfinite: jax.Array  # shape=(), bool: dropped by skip_nonfinite.
  skipped: jax.Array  # shape=(), bool: dropped by should_skip.


def _cycle_length(
    every_k: int | Callable[[jax.Array], jax.Array], count: jax.Array
) -> jax.Array:
  """Micro-steps in the cycle that ends with update number ``count + 1``."""
  if not callable(every_k):
    return jnp.asarray(every_k, jnp.int32)
  length = jnp.asarray(every_k(count))
  if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
    raise TypeError(
        "every_k(count) must return an integer scalar, got"
        f" {length.dtype}{list(length.shape)}."
    )
  return jnp.maximum(length.astype(jnp.int32), 1)


def _all_finite(tree: Any) -> jax.Array:
  finite = jnp.bool_(True)
  for leaf in jax.tree.leaves(tree):
    finite &= jnp.all(jnp.isfinite(leaf))
  return finite


def _drops(updates, tokens, state, params, skip_nonfinite, should_skip):
  """Whether ``skip_nonfinite`` and ``should_skip`` drop this micro-step."""
  nonfinite = jnp.bool_(False)
  if skip_nonfinite:
    # A micro-step without tokens adds nothing whatever its gradient (often
    # a 0/0 mean): it is not a dropped one.
    bad_grads = ~_all_finite(updates) & (tokens != 0)
    nonfinite = token_weighting.is_bad_count(tokens) | bad_grads
  skipped = jnp.bool_(False)
  if should_skip is not None:
    skipped = validation.check_predicate(
        "should_skip(grads, state, params)", should_skip(updates, state, params)
    )
  return _Drops(nonfinite=nonfinite, skipped=skipped)


def _add_to_sum(grad_sum, updates, contribution, cycle_start, rules):
  """The running sum after this micro-step, with the lazy reset.

  The call that starts a cycle (``micro_step == 0``) adds to zeros instead of
  to the stored sum, which still holds the finished cycle's. Zeroing the sum
  in the emitting branch instead would make it an output of the
  ``lax.cond``, which XLA cannot write in place: every accumulator (and, on
  CPU, inner-state) buffer would then be copied on every micro-step. This way
  a non-emitting call is one fused in-place pass over the sum, and the
  conditional only reads it.
  """
  restarted = grad_reduction_lib.restart(grad_sum, rules, cycle_start)
  return grad_reduction_lib.add(restarted, updates, contribution, rules)


def _should_emit(emit, micro_step, length, axis_name):
  """The emit decision: the every_k rule, or the caller's ``emit``."""
  if emit is None:
    return micro_step >= length
  emit = validation.check_predicate("emit", emit)
  if axis_name is not None:
    validation.check_same_on_every_device("emit", emit, axis_name)
  return emit


def _increment_where(flag, counter):
  return jnp.where(flag, optax.safe_increment(counter), counter)


def _zero_where(flag, tree):
  return jax.tree.map(lambda x: jnp.where(flag, jnp.zeros_like(x), x), tree)


def _next_state(state, micro_step, emit, cycle: emitting.Cycle,
                emitted: emitting.Emitted, drops):
  return AccumulateState(
      micro_step=_zero_where(emit, micro_step),
      count=_increment_where(emitted.updated, state.count),
      grad_sum=cycle.grad_sum,  # reset lazily: see _add_to_sum.
      token_count=_zero_where(emit, cycle.token_count),
      inner_state=emitted.inner_state,
      emitted=emitted.updated,
      nonfinite_count=_increment_where(drops.nonfinite, state.nonfinite_count),
      skipped_count=_increment_where(drops.skipped, state.skipped_count),
      stats_sums=_zero_where(emit, cycle.stats_sums),
      stats=emitted.stats,
  )


def _cycle_after(state, grads, contribution, loss_reduction,
                 rules) -> emitting.Cycle:
  """The running sums with this micro-step added."""
  stats_sums = state.stats_sums
  if stats_sums is not None:
    stats_sums = noise_scale.add(
        stats_sums, grad_reduction_lib.only_means(grads, rules), contribution,
        loss_reduction)
  return emitting.Cycle(
      grad_sum=_add_to_sum(
          state.grad_sum, grads, contribution, state.micro_step == 0, rules
      ),
      token_count=state.token_count + contribution.tokens,
      stats_sums=stats_sums,
  )


def _init_state(inner_state, params, accumulator_dtype, axis_name,
                with_stats) -> AccumulateState:
  """The state before the first micro-step."""

  def partial_zeros(shape, dtype):
    # With an axis, the running sums are this device's partial sums; a
    # leading slot axis lets shard_map lay them out one slot per device
    # (scalars included), so that no device's partial sum can be dropped.
    if axis_name is None:
      return jnp.zeros(shape, dtype)
    return partial_sums.partial_zeros(shape, dtype, axis_name)

  return AccumulateState(
      micro_step=jnp.zeros([], jnp.int32),
      count=jnp.zeros([], jnp.int32),
      grad_sum=jax.tree.map(
          lambda p, dtype: partial_zeros(
              jnp.shape(p), incoming_grads.sum_dtype(p, dtype)
          ),
          params, validation.per_leaf_dtypes(accumulator_dtype, params),
      ),
      token_count=partial_zeros((), jnp.float32),
      inner_state=inner_state,
      emitted=jnp.zeros([], jnp.bool_),
      nonfinite_count=partial_zeros((), jnp.int32),
      skipped_count=partial_zeros((), jnp.int32),
      stats_sums=noise_scale.StatsSums(
          partial_zeros((), jnp.float32), partial_zeros((), jnp.float32)
      ) if with_stats else None,
      stats=noise_scale.nan_stats() if with_stats else None,
  )


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array],
    *,
    loss_reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | tuple[str, ...] | None = None,
    skip_nonfinite: bool = False,
    should_skip: Callable[[Any, Any, Any], Any] | None = None,
    with_stats: bool = False,
    grad_reduction: Any = "mean",
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates micro-batch gradients and updates once per cycle.

  Each call takes the gradient of one micro-batch. With
  ``loss_reduction="mean"`` the gradient is of a loss averaged over
  ``num_tokens`` items, so the call adds ``num_tokens * grads`` to a running
  sum; with ``"sum"`` it adds ``grads`` as they are. In both cases it adds
  ``num_tokens`` to a running token count. On the ``every_k``-th call of a
  cycle (or a call with ``emit=True``) the transformation hands ``inner`` the
  exact token-weighted mean

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
  mean handed to ``inner`` has the gradients' dtype. A micro-step with zero
  tokens adds nothing (its gradient is not looked at, so a 0/0 mean cannot
  leak NaN). A cycle with no tokens emits zero updates and leaves ``inner``'s
  state untouched. A ``num_tokens`` that is NaN, infinite or negative is never
  used as a weight: a concrete one raises; a traced one is dropped (and
  counted) under ``skip_nonfinite``, and otherwise makes the emitted update
  NaN. With ``axis_name``, gradients and token counts stay local to each
  device through the cycle and are summed over the axis once, inside the
  emitting branch; use it inside :func:`jax.shard_map` (on gradients taken
  with respect to :func:`optax_accum.device_local` parameters) or
  :func:`jax.pmap`, with :func:`optax_accum.state_partition_specs` for the
  state's specs.

  Args:
    inner: the optimizer to run on the accumulated gradient.
    every_k: micro-steps per optimizer update: a positive int, or a callable
      mapping the number of updates emitted so far (``state.count``) to a cycle
      length (for a batch-size warm-up). Lengths below one count as one.
    loss_reduction: how each incoming gradient's loss was reduced over its
      ``num_tokens`` items: ``"mean"`` or ``"sum"``.
    accumulator_dtype: floating dtype of the running sum, or a pytree prefix
      of the parameters of such dtypes, e.g. ``{'embed': jnp.bfloat16,
      'layers': jnp.float32}``: one per parameter (sub)tree.
    axis_name: data-parallel axis (or axes) to sum over on emit, or None.
    skip_nonfinite: if True, a micro-step whose gradient (or ``num_tokens``)
      has a NaN or Inf, or whose ``num_tokens`` is negative, adds nothing,
      neither gradient nor tokens, but still counts as a micro-step of the
      cycle; ``state.nonfinite_count`` counts them.
    should_skip: None, or ``should_skip(grads, state, params)`` returning a
      bool scalar: a micro-step for which it is true adds nothing, like a
      non-finite one, and ``state.skipped_count`` counts it. ``state`` is
      this transformation's state before the call.
    with_stats: if True, each emitting call also estimates the gradient
      noise scale from the cycle's micro-step gradients (read it with
      :func:`optax_accum.grad_stats`): one squared norm per micro-step, and
      with ``axis_name`` two scalars more in the one reduction per update.
    grad_reduction: how each gradient leaf is reduced over the cycle:
      ``"mean"`` (the token-weighted mean above), ``"max"`` (the maximum over
      the cycle's kept micro-steps, and over devices with ``axis_name``: FP8
      amax histories and scales), ``"last"`` (the last kept micro-step's
      value; not with ``axis_name``), or a pytree prefix of the gradient of
      those. A kept micro-step has tokens and was not dropped; a "max" or
      "last" leaf takes the raw gradient (not weighted, not divided by the
      token count), and zeros if no micro-step was kept. Only "mean" leaves
      count in ``with_stats``' statistics.

  Returns:
    A :class:`optax.GradientTransformationExtraArgs` whose ``update`` takes
    ``(grads, state, params=None, *, num_tokens=None, emit=None,
    **extra_args)``. ``num_tokens=None`` counts as one. ``emit=None`` keeps
    the ``every_k`` rule; ``emit=True`` (a Python or traced bool) ends the
    cycle on this call, ``emit=False`` forbids ending it (a traced ``emit``
    is the whole decision; with ``axis_name`` it must be the same on every
    device). ``emit`` is never passed to ``inner``. A flush with no new
    gradient is ``update(zero_grads, state, params, num_tokens=0,
    emit=True)``. ``extra_args`` go on to ``inner``; a keyword that looks
    like a typo of ``num_tokens`` or ``emit``, or any keyword when ``inner``
    is a plain :class:`optax.GradientTransformation`, raises ``TypeError``.
    Gradient leaves may be Python scalars or NumPy arrays; integer ones are
    averaged in ``accumulator_dtype``; complex ones need complex parameters.

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
    >>> # The end of an epoch: a partial window, emitted now.
    >>> updates, state = tx.update(g1, state, params, num_tokens=2, emit=True)
    >>> updates['w']
    Array([-4.,  0.], dtype=float32)
  """
  every_k = validation.check_every_k(every_k)
  loss_reduction = validation.check_loss_reduction(loss_reduction)
  accumulator_dtype = validation.check_accumulator_dtypes(accumulator_dtype)
  axis_name = validation.check_axis_name(axis_name)
  skip_nonfinite = validation.check_bool("skip_nonfinite", skip_nonfinite)
  should_skip = validation.check_optional_callable("should_skip", should_skip)
  with_stats = validation.check_bool("with_stats", with_stats)
  grad_reduction = grad_reduction_lib.check(grad_reduction, axis_name)
  validation.check_transformation("inner", inner)
  takes_extra_args = isinstance(inner, optax.GradientTransformationExtraArgs)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return _init_state(inner.init(params), params, accumulator_dtype,
                       axis_name, with_stats)

  def update_fn(updates, state, params=None, *, num_tokens=None, emit=None,
                **extra_args):
    validation.refuse_near_misses(extra_args, ("num_tokens", "emit"))
    if extra_args and not takes_extra_args:
      validation.refuse_extra_args("inner", extra_args)
    tokens = validation.as_token_count("num_tokens", num_tokens)
    updates = incoming_grads.checked_grads(
        updates, state.grad_sum, axis_name, num_tokens
    )
    drops = _drops(updates, tokens, state, params, skip_nonfinite, should_skip)
    contribution = token_weighting.contribution(
        tokens, loss_reduction, drop=drops.nonfinite | drops.skipped
    )
    rules = grad_reduction_lib.per_leaf(grad_reduction, updates)
    cycle = _cycle_after(state, updates, contribution, loss_reduction, rules)
    micro_step = optax.safe_increment(state.micro_step)
    emit = _should_emit(
        emit, micro_step, _cycle_length(every_k, state.count), axis_name
    )
    emitter = emitting.emitter(
        inner, axis_name, updates, state.inner_state, params, extra_args, rules
    )
    emitted = lax.cond(
        emit, emitter.emit, emitter.skip, cycle, state.inner_state,
        state.stats,
    )
    new_state = _next_state(state, micro_step, emit, cycle, emitted, drops)
    return emitted.updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
