"""Gradient accumulation, an optax transformation: one micro-batch per call."""

from collections.abc import Callable
import sys
import types
from typing import Any

import jax
import optax

from optax_accum._src import flax_nnx
from optax_accum._src import keyword_names
from optax_accum._src import validation
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import update_call
from optax_accum._src.accumulate import zero_sums
from optax_accum._src.rules import grad_reduction as grad_reduction_lib


def _closure_code(factory, name: str) -> types.CodeType | None:
  """The code of ``factory``'s inner function ``name`` (None if not found)."""
  code = getattr(factory, "__code__", None)
  if code is None:
    return None
  for const in code.co_consts:
    if isinstance(const, types.CodeType) and const.co_name == name:
      return const
  return None


# The init of each wrapper that may skip its inner's update.
_SKIPPING_INITS = {
    "optax.apply_if_finite": _closure_code(optax.apply_if_finite, "init"),
}

_MESSAGE = (
    "oa.accumulate inside {wrapper}: the wrapper skips accumulate's update"
    " on a non-finite gradient and keeps its old state, so the skipped"
    " micro-batch is not counted and every later update boundary shifts by"
    " one micro-batch. Drop the bad micro-batch inside accumulate instead:"
    " oa.accumulate(inner, every_k, skip_nonfinite=True) (the window still"
    " ends on time, without it), or wrap the inner optimizer:"
    " oa.accumulate({wrapper}(inner, max_consecutive_errors), every_k) (a"
    " window whose mean is not finite makes no update)."
)


def _check_not_in_skipping_wrapper() -> None:
  """Raises if a wrapper that skips updates is initialising us.

  Such a wrapper (``optax.apply_if_finite`` rejecting a non-finite
  gradient) runs our ``update`` on some calls only and keeps our old state
  on the others, which loses micro-steps silently: every later window ends
  one micro-batch late (24 micro-batches meant as 6 updates of 4 become 5
  updates and 3 micro-steps left over). We cannot see the rejection, so
  the placement is refused at ``init``, where the wrapper's ``init`` calls
  ours: the frames above are looked at, nothing else.
  """
  codes = {code: name for name, code in _SKIPPING_INITS.items() if code}
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    wrapper = codes.get(frame.f_code)
    if wrapper is not None:
      raise ValueError(_MESSAGE.format(wrapper=wrapper))
    frame = frame.f_back


class AccumulateTransformation(optax.GradientTransformationExtraArgs):
  """What :func:`optax_accum.accumulate` returns: an optax transformation
  that can also apply its updates itself, in its emitting branch.

  It is an :class:`optax.GradientTransformationExtraArgs` (it chains, and
  ``flax.nnx.Optimizer`` takes it) whose type says it offers the copy-free
  step :meth:`update_and_apply`, which :func:`optax_accum.update_and_apply`
  calls. An ``optax.chain`` around it is a plain transformation:
  :func:`optax_accum.update_and_apply` then runs ``update`` and
  :func:`optax_accum.apply_if_updated`, as documented there.

  Attributes:
    init: ``init(params) -> AccumulateState``.
    update: ``update(grads, state, params=None, *, num_tokens=None,
      emit=None, **extra_args) -> (updates, state)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(1.0), every_k=1, equal_weights=True)
    >>> isinstance(tx, oa.AccumulateTransformation)
    True
    >>> params = {'w': jnp.ones(2)}
    >>> params, state = tx.update_and_apply({'w': jnp.ones(2)},
    ...                                     tx.init(params), params)
    >>> params['w']
    Array([0., 0.], dtype=float32)
  """

  __slots__ = ()

  def update_and_apply(self, grads, state, params, *, num_tokens=None,
                       emit=None, **extra_args):
    """``params`` with this micro-step's update applied, and the state.

    :func:`optax_accum.update_and_apply` with this transformation.
    """
    return self.update.step(grads, state, params, num_tokens, emit,
                            extra_args, True)


@keyword_names.takes_only_own_keywords({
    "use_grad_mean": (
        "optax.MultiSteps' use_grad_mean=True is the default here, made exact:"
        " pass num_tokens=n to each tx.update call (the token-weighted mean,"
        " the full batch's gradient), or equal_weights=True where every"
        " micro-batch holds as many tokens (docs/migrating.md)."),
    "every_k_schedule": "write every_k=k (an int or a function of the"
                        " update count, as MultiSteps' every_k_schedule).",
    "should_skip_update_fn": (
        "write skip_nonfinite=True for optax.skip_not_finite, or"
        " should_skip=fn with fn(grads, state, params) -> bool."),
    "k": "write every_k=k.",
    "num_microbatches": "write every_k=k: the micro-steps per update.",
    "num_tokens": ("num_tokens belongs to each tx.update call (the tokens of"
                   " that micro-batch), not to oa.accumulate."),
})
def accumulate(
    inner: optax.GradientTransformation,
    every_k: int | Callable[[jax.Array], jax.Array] | None,
    *,
    loss_reduction: str = "mean",
    accumulator_dtype: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    skip_nonfinite: bool = False,
    should_skip: Callable[[Any, Any, Any], Any] | None = None,
    with_stats: bool = False,
    equal_weights: bool = False,
    grad_reduction: Any = "mean",
    value_fn_over_window: bool = False,
    shard_optimizer: str | tuple[str, ...] | None = None,
    gradient_sync: str = "once",
) -> AccumulateTransformation:
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

  The sum is kept in ``accumulator_dtype``, by default the wider of float32
  and each parameter's dtype (bfloat16 gradients are summed in float32,
  float64 ones under ``jax_enable_x64`` in float64); the mean handed to
  ``inner`` has the gradients' dtype. A micro-step with zero
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
  count. Save :func:`optax_accum.checkpointable_state` of such a state in
  a mid-cycle checkpoint. The forms are told in ``docs/distributed.md``.

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
      'layers': jnp.float32}``: one per parameter (sub)tree. None (the
      default, also as a leaf of such a tree): the wider of float32 and the
      parameter's dtype.
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
    value_fn_over_window: True says that a ``value_fn`` passed to ``update``
      (a line search's loss as a function of the parameters) evaluates the
      whole window's loss: it is then passed to ``inner`` as given on the
      emitting call. Otherwise a ``value_fn`` raises, naming the one-call
      recipe (see Returns).
    shard_optimizer: ZeRO: the data axes (Explicit axes of the mesh set
      with :func:`jax.set_mesh`, under :func:`jax.jit`) to shard ``inner``'s
      state over, each leaf as :func:`optax_accum.zero_specs` says, while
      the parameters stay as they are. ``inner`` then updates each device's
      shard of the mean, and the emitting branch gathers the updates back
      (one all-gather per update); or None. ``inner`` must work leaf by
      leaf on shards (adamw, lion, sgd; not Muon's whole matrices).
    gradient_sync: with ``shard_optimizer``, how the gradients reach the
      shards: ``"once"`` (ZeRO-1: the running sum kept whole, unreduced for
      ``gradient_sync="deferred"`` gradients, and reduce-scattered on emit:
      one reduce-scatter per update) or ``"every_microbatch"`` (ZeRO-2: the
      running sum sharded too, each call's gradient reduce-scattered into
      it: 1/N of its memory, ``k`` reduce-scatters per update).

  Returns:
    An :class:`AccumulateTransformation`, an
    :class:`optax.GradientTransformationExtraArgs` whose ``update`` takes
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
    emit=True)``. ``extra_args`` reach ``inner`` on the emitting call,
    each by its rule over the window: ``value`` (a real scalar, e.g. the
    micro-batch's loss for ``optax.contrib.reduce_on_plateau`` or a line
    search) as the token-weighted mean of the values passed during the
    window, with the gradient's weights (skipped, dropped and empty
    micro-steps excluded; summed over the devices with the gradient, in
    every form), so that ``inner`` sees the full batch's loss; ``grad`` as
    the window's mean gradient; ``value_fn`` is refused (it cannot be summed
    over micro-batches: take the full batch's loss and gradient with
    :func:`optax_accum.value_and_grad` and call the line search directly)
    unless ``value_fn_over_window``; every other one as given on the
    emitting call. A keyword that looks like a typo of ``num_tokens`` or
    ``emit``, or any keyword when ``inner`` is a plain
    :class:`optax.GradientTransformation`, raises ``TypeError``.
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
  missing_count = update_call.missing_count(equal_weights)
  grad_reduction = grad_reduction_lib.check_grad_reduction(grad_reduction,
                                                           axis_name)
  value_fn_over_window = validation.check_bool("value_fn_over_window",
                                               value_fn_over_window)
  zero = zero_sums.check(shard_optimizer, gradient_sync, axis_name,
                         with_stats, grad_reduction)
  validation.check_transformation("inner", inner)
  takes_extra_args = isinstance(inner, optax.GradientTransformationExtraArgs)
  inner = optax.with_extra_args_support(inner)

  settings = sum_layout.UpdateSettings(
      loss_reduction, axis_name, skip_nonfinite, should_skip, grad_reduction,
      with_stats, accumulator_dtype, zero)

  def init_fn(params):
    _check_not_in_skipping_wrapper()
    validation.check_param_leaves(params)
    flax_nnx.check_slots_fit_params(axis_name, params)
    # Raises unless grad_reduction fits the params.
    grad_reduction_lib.rules_per_leaf(grad_reduction, params)
    layout = update_call.layout_for(settings, params)
    return state_lib.first_state(layout.init(inner, params, settings))

  step = update_call.Step(inner, every_k, settings, takes_extra_args,
                          value_fn_over_window, missing_count)
  return AccumulateTransformation(init_fn, update_call.Update(step))
