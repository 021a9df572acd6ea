"""Gradient accumulation, an optax transformation: one micro-batch per call."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import validation
from optax_accum._src.accumulate import emitting
from optax_accum._src.accumulate import incoming_grads
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import partial_sums
from optax_accum._src.accumulate import sum_layouts
from optax_accum._src.accumulate import unreduced_sums
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


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
    stats_sums: with ``with_stats``, the current cycle's running sums behind
      the noise scale's estimate (float32 scalars; per device); else None.
    stats: with ``with_stats``, the :class:`GradStats` of the last cycle that
      emitted (read them with :func:`optax_accum.grad_stats`); else None.
    tokens_seen: the tokens behind every update emitted since ``init``: the
      sum of the token counts that the updates' means divided by, over every
      device (read it with :func:`optax_accum.tokens_seen`); float32, the
      same on every device.
    tokens_seen_error: the rounding error of ``tokens_seen``'s running sum,
      carried into the next addition (Kahan summation), so that the count
      does not drift over billions of tokens; float32.
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
  tokens_seen: jax.Array  # shape=(), dtype=jnp.float32.
  tokens_seen_error: jax.Array  # shape=(), dtype=jnp.float32.


# The fields of AccumulateState that hold per-device scalars under axis_name.
PER_DEVICE_COUNTS = (
    "token_count", "nonfinite_count", "skipped_count", "stats_sums"
)


def _cycle_length(
    every_k: int | Callable[[jax.Array], jax.Array] | None, count: jax.Array
) -> jax.Array | None:
  """Micro-steps in the cycle that ends with update number ``count + 1``.

  None when ``every_k`` is None: no cycle ends by count.
  """
  if every_k is None:
    return None
  if not callable(every_k):
    return jnp.asarray(every_k, jnp.int32)
  length = jnp.asarray(every_k(count))
  if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
    raise TypeError(
        "every_k(count) must return an integer scalar, got"
        f" {length.dtype}{list(length.shape)}."
    )
  return jnp.maximum(length.astype(jnp.int32), 1)


def _should_emit(emit, micro_step, length, layout):
  """The emit decision: the every_k rule OR the caller's ``emit``.

  ``emit`` can only end a cycle early, never hold one open: with
  ``emit=(i == last)`` every other call must still follow ``every_k``, or an
  epoch's updates silently collapse into one. ``length`` is None when
  ``every_k`` is None, and then ``emit`` alone decides.
  """
  by_count = jnp.bool_(False) if length is None else micro_step >= length
  if emit is None:
    return by_count
  emit = validation.check_predicate("emit", emit)
  layout.check_emit(emit)
  return emit | by_count


def _zero_where(flag, tree):
  return jax.tree.map(lambda x: jnp.where(flag, jnp.zeros_like(x), x), tree)


def _compensated_add(total, error, x):
  """``total + x`` in float32, the rounding error kept (Kahan summation)."""
  y = x - error
  new_total = total + y
  return new_total, (new_total - total) - y


def _next_state(state, micro_step, emit, step: microstep.MicroStep,
                emitted: emitting.Emitted):
  cycle = step.cycle
  tokens_seen, tokens_seen_error = _compensated_add(
      state.tokens_seen, state.tokens_seen_error, emitted.tokens)
  return AccumulateState(
      micro_step=_zero_where(emit, micro_step),
      count=microstep.increment_where(emitted.updated, state.count),
      grad_sum=cycle.grad_sum,  # reset lazily: see microstep.add_to_sum.
      token_count=_zero_where(emit, cycle.token_count),
      inner_state=emitted.inner_state,
      emitted=emitted.updated,
      nonfinite_count=step.nonfinite_count,
      skipped_count=step.skipped_count,
      stats_sums=_zero_where(emit, cycle.stats_sums),
      stats=emitted.stats,
      tokens_seen=tokens_seen,
      tokens_seen_error=tokens_seen_error,
  )


def _init_state(inner_state, params, accumulator_dtype, axis_name,
                with_stats) -> AccumulateState:
  """The state before the first micro-step."""

  def partial_zeros(shape, dtype):
    # With an axis, the running sums are this device's partial sums; a
    # leading slot axis lets shard_map lay them out one slot per device
    # (scalars included), so that no device's partial sum can be dropped.
    return partial_sums.partial_zeros(shape, dtype, axis_name)

  def sum_zeros(param, accumulator_dtype):
    dtype = incoming_grads.sum_dtype(param, accumulator_dtype)
    if axis_name is not None and partial_sums.slots_sharded_by_type(axis_name):
      # Under a mesh with Explicit axes: slots sharded like the parameter,
      # ready for unreduced gradients under jit (and for shard_map).
      return unreduced_sums.slot_zeros(param, dtype, axis_name)
    if axis_name is None:
      # Shaped and sharded like the parameter (as optax's zeros_like): all
      # that unreduced gradients under jit need too (accumulate_forms).
      return jnp.zeros_like(param, dtype=dtype)
    return partial_zeros(jnp.shape(param), dtype)

  def count_zeros(dtype):
    if axis_name is None:
      return jnp.zeros([], dtype)
    return partial_zeros((), dtype)

  return AccumulateState(
      micro_step=jnp.zeros([], jnp.int32),
      count=jnp.zeros([], jnp.int32),
      grad_sum=jax.tree.map(
          sum_zeros, params,
          validation.per_leaf_dtypes(accumulator_dtype, params)),
      token_count=count_zeros(jnp.float32),
      inner_state=inner_state,
      emitted=jnp.zeros([], jnp.bool_),
      nonfinite_count=count_zeros(jnp.int32),
      skipped_count=count_zeros(jnp.int32),
      stats_sums=noise_scale.StatsSums(
          count_zeros(jnp.float32), count_zeros(jnp.float32)
      ) if with_stats else None,
      stats=noise_scale.nan_stats() if with_stats else None,
      tokens_seen=jnp.zeros([], jnp.float32),
      tokens_seen_error=jnp.zeros([], jnp.float32),
  )


def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array] | None,
    *,
    loss_reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    axis_name: str | tuple[str, ...] | None = None,
    skip_nonfinite: bool = False,
    should_skip: Callable[[Any, Any, Any], Any] | None = None,
    with_stats: bool = False,
    equal_weights: bool = False,
    grad_reduction: Any = "mean",
) -> optax.GradientTransformationExtraArgs:
  r"""Accumulates micro-batch gradients and updates once per cycle.

  Each call takes the gradient of one micro-batch. With
  ``loss_reduction="mean"`` the gradient is of a loss averaged over
  ``num_tokens`` items, so the call adds ``num_tokens * grads`` to a running
  sum; with ``"sum"`` it adds ``grads`` as they are. In both cases it adds
  ``num_tokens`` to a running token count. On the ``every_k``-th call of a
  cycle, or on any call with ``emit=True``, the transformation hands
  ``inner`` the exact token-weighted mean

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
  NaN.

  On several devices the sums are reduced once per update, inside the
  emitting branch. Inside :func:`jax.shard_map` or :func:`jax.pmap`, pass
  ``axis_name``: each device keeps its own partial sums (see
  :func:`optax_accum.state_partition_specs`). Under :func:`jax.jit` with
  Explicit mesh axes, gradients typed *unreduced* over the data axes
  (:func:`optax_accum.value_and_grad` ``(..., gradient_sync="deferred")``:
  PyTorch DDP's ``no_sync`` loop, one jit call per micro-batch) need no
  ``axis_name``: their type says over which axes, the running sum keeps it
  from the first such call on, and ``num_tokens`` is the batch's global
  count. Save :func:`optax_accum.reduced_state` of such a state in a
  mid-cycle checkpoint. The forms are told in ``docs/distributed.md``.

  Args:
    inner: the optimizer to run on the accumulated gradient.
    every_k: micro-steps per optimizer update: a positive int, a callable
      mapping the number of updates emitted so far (``state.count``) to a cycle
      length (for a batch-size warm-up; lengths below one count as one), or
      None: cycles end only where ``update`` is passed ``emit=True`` (a
      boundary chosen by the data, e.g. a token budget).
    loss_reduction: how each incoming gradient's loss was reduced over its
      ``num_tokens`` items: ``"mean"`` or ``"sum"``.
    accumulator_dtype: floating dtype of the running sum, or a pytree prefix
      of the parameters of such dtypes, e.g. ``{'embed': jnp.bfloat16,
      'layers': jnp.float32}``: one per parameter (sub)tree.
    axis_name: the manual data-parallel axis (or axes) to sum over on emit
      (shard_map, pmap), or None. Under jit, given with unreduced
      gradients, it must name the axes their types say (its state then
      keeps a slot per device, laid out by ``tx.init`` under the mesh).
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
    equal_weights: True says that every micro-batch is meant to weigh the
      same (they hold the same number of tokens): ``update`` calls without
      ``num_tokens`` then count as one token each without the
      ``UserWarning`` they give otherwise, once, at the first trace. A
      ``num_tokens`` that is passed still counts (``num_tokens=0`` for a
      flush).
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
    **extra_args)``. ``num_tokens=None`` counts as one (see
    ``equal_weights``). ``emit=True`` (a Python or traced bool) ends the
    cycle on this call, whatever ``micro_step`` is; ``emit=False`` and
    ``emit=None`` add nothing, so the cycle still ends on its ``every_k``-th
    call: ``emit`` is OR-ed with the ``every_k`` rule, traced or not, and
    ``emit=(i == last)`` ends an epoch's partial last cycle without touching
    the others. With ``axis_name`` it must be the same on every device.
    ``emit`` is never passed to ``inner``. A flush with no new
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
  missing_count = token_weighting.MissingCount(
      "oa.accumulate",
      "num_tokens=n to each update call (n: the number of tokens that"
      " micro-batch's loss averaged over)",
      validation.check_bool("equal_weights", equal_weights),
  )
  grad_reduction = grad_reduction_lib.check(grad_reduction, axis_name)
  validation.check_transformation("inner", inner)
  takes_extra_args = isinstance(inner, optax.GradientTransformationExtraArgs)
  inner = optax.with_extra_args_support(inner)

  settings = microstep.UpdateSettings(
      loss_reduction, axis_name, skip_nonfinite, should_skip, grad_reduction,
      with_stats)

  def init_fn(params):
    validation.check_param_leaves(params)
    grad_reduction_lib.per_leaf(grad_reduction, params)  # fits the params?
    return _init_state(inner.init(params), params, accumulator_dtype,
                       axis_name, with_stats)

  def update_fn(updates, state, params=None, *, num_tokens=None, emit=None,
                **extra_args):
    validation.refuse_near_misses(extra_args, ("num_tokens", "emit"))
    if extra_args and not takes_extra_args:
      validation.refuse_extra_args("inner", extra_args)
    layout = sum_layouts.detect(axis_name, updates, state.grad_sum)
    if num_tokens is None:
      tokens = missing_count.count()  # warned once the call is checked.
    else:
      tokens = validation.as_token_count("num_tokens", num_tokens)
    step = layout.add(updates, state, params, num_tokens, tokens, settings)
    micro_step = optax.safe_increment(state.micro_step)
    emit = _should_emit(
        emit, micro_step, _cycle_length(every_k, state.count), layout)
    emitter = emitting.emitter(
        inner, layout, step.grads, state.inner_state, params, extra_args,
        step.leaf_rules,
    )
    emitted = lax.cond(
        emit, emitter.emit, emitter.skip, step.cycle, state.inner_state,
        state.stats,
    )
    new_state = _next_state(state, micro_step, emit, step, emitted)
    if num_tokens is None:
      missing_count.warn()
    return emitted.updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
