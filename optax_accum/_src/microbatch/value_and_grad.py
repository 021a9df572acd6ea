"""The micro-batch loop: a full batch's exact gradient, by micro-batch."""

from collections.abc import Callable
import functools
from typing import Any

from optax_accum._src import keyword_names
from optax_accum._src import names
from optax_accum._src import validation
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import loop as loop_lib
from optax_accum._src.microbatch import loop_program
from optax_accum._src.microbatch import loss_signature
from optax_accum._src.microbatch import rng as rng_lib
from optax_accum._src.microbatch import runner
from optax_accum._src.microbatch import trip_count
from optax_accum._src.rules import aux_reduction as aux_reduction_lib
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import token_weighting


@keyword_names.takes_only_own_keywords({
    "num_tokens": ("write num_tokens_fn=lambda mb: ..., a function of one"
                   " micro-batch returning the number of tokens its loss"
                   " averaged over (e.g. lambda mb: mb['mask'].sum())."),
    "every_k": "write num_microbatches=k.",
    "k": "write num_microbatches=k.",
    "num_micro_batches": "write num_microbatches=k.",
    "use_grad_mean": ("the result is the token-weighted mean with"
                      " num_tokens_fn, or the plain mean over micro-batches"
                      " with equal_weights=True."),
    "argnums": ("it differentiates loss_fn's first argument (the"
                " parameters), as jax.value_and_grad does by default."),
})
def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int,
    has_aux: bool = False,
    has_state: bool = False,
    num_tokens_fn: Callable[[Any], Any] | None = None,
    equal_weights: bool = False,
    loss_reduction: str = "mean",
    axis_name: str | tuple[str, ...] | None = None,
    accumulator_dtype: Any = None,
    batch_axes: Any = 0,
    aux_reduction: Any = "stack",
    with_stats: bool = False,
    gradient_sync: str = "once",
    gather_params: str = "once",
    param_specs: Any = None,
    grad_reduction: Any = "mean",
    overlap_reduction: bool = False,
) -> Callable[..., Any]:
  r"""Like :func:`jax.value_and_grad`, over a batch split into micro-batches.

  One loop (a :func:`jax.lax.scan`, or a while loop of k trips where an
  empty micro-batch borrows another's data: docs/semantics.md) computes one
  micro-batch's loss and gradient at a time (one micro-batch's activations
  alive at once). With ``n_i =
  num_tokens_fn(microbatch_i)`` and ``loss_fn`` a mean ``L_i`` over those
  tokens, the result is the full batch's token-weighted mean, exactly (to
  float rounding), however unevenly the tokens fall:

  .. math::
    L = \frac{\sum_i n_i L_i}{\sum_i n_i}, \qquad
    \nabla L = \frac{\sum_i n_i \nabla L_i}{\sum_i n_i}.

  Micro-batch ``i`` is the ``i``-th of ``k`` contiguous blocks of each
  device's rows. Under a mesh, ``shard_map`` or ``pmap`` the gradient is
  reduced over the data axes once, after the loop, in each of the four
  forms of ``docs/distributed.md``.

  Args:
    loss_fn: ``loss_fn(params, microbatch, *args, **kwargs)`` returning a
      scalar, or ``(loss, aux)`` with ``has_aux``; with ``has_state``,
      ``loss_fn(params, model_state, microbatch, ...)`` returning ``(loss,
      new_model_state)`` (or ``(loss, (new_model_state, aux))``). It takes
      ``rng=`` when ``fn`` is called with a key (``fold_in(key, i)``).
    num_microbatches: how many micro-batches ``k`` to split the batch into.
    has_aux: whether ``loss_fn`` returns aux, reduced by ``aux_reduction``.
    has_state: whether ``loss_fn`` threads model state through the loop.
    num_tokens_fn: a micro-batch's weight ``n_i`` (its unmasked tokens).
    equal_weights: every micro-batch weighs the same, without the warning
      that a missing ``num_tokens_fn`` gives.
    loss_reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces.
    axis_name: the data axes: manual (``shard_map``, ``pmap``) or of the
      mesh (``jit``; read off the batch with Explicit axes).
    accumulator_dtype: dtype of the sums, or a prefix tree of params of them;
      None (the default): the wider of float32 and each parameter's dtype
      (float64 stays float64 under ``jax_enable_x64``).
    batch_axes: each batch leaf's axis to split (like ``vmap``'s
      ``in_axes``); None passes the leaf whole to every micro-batch.
    aux_reduction: ``"stack"``, ``"mean"`` (token-weighted), ``"sum"``,
      ``"max"``, ``"min"``, or a prefix tree of aux of those.
    with_stats: also return an :class:`optax_accum.GradStats` (the gradient
      noise scale, ``docs/noise_scale.md``), at the cost of a few scalars.
    gradient_sync: ``"once"``, ``"every_microbatch"`` (FSDP: reduce-scatter
      each micro-batch's gradient), or ``"deferred"`` (return each device's
      partial, unreduced, for :func:`optax_accum.accumulate`).
    gather_params: ``"once"`` or ``"every_microbatch"`` (FSDP: gather the
      parameters for each micro-batch); see ``docs/distributed.md``.
    param_specs: the parameters' ``PartitionSpec`` over the data axes (one,
      or a prefix tree); None: read off their types, or replicated. The
      gradient comes back sharded so: for ZeRO (parameters replicated, the
      optimizer's state sharded over the data axes) pass
      ``oa.zero_specs(params, axis_name)``, and each leaf is reduce-scattered
      into its shard (``docs/zero.md``).
    grad_reduction: per leaf, ``"mean"``, ``"max"`` or ``"last"`` over the
      micro-batches (FP8 scales: ``docs/fp8.md``), or a prefix tree.
    overlap_reduction: run the last micro-batch after the loop, so that
      XLA may start each leaf's reduction over the data axes as soon as
      that backward pass has produced its gradient, beside the rest of it
      (GPUs; TPUs with the flags of ``docs/performance.md``, "Hiding the
      one reduction", has what share it hides, and at what memory and
      compile time). It costs compile time: the program holds the forward
      and backward twice. Only where every leaf is reduced after the loop,
      and k > 1.

  Returns:
    ``fn(params, batch, *args, rng=None, num_real_microbatches=None,
    **kwargs)`` (``fn(params, model_state, batch, ...)`` with ``has_state``)
    returning ``(value, grads)`` as :func:`jax.value_and_grad` would for
    ``loss_fn``, and ``stats`` third with ``with_stats``.
    ``num_real_microbatches=n`` computes only the first ``n``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax_accum as oa
    >>> def loss_fn(w, mb):  # mean squared error over the unmasked rows
    ...   err = mb['mask'] * (mb['x'] * w - mb['y']) ** 2
    ...   return err.sum() / jnp.maximum(mb['mask'].sum(), 1)
    >>> batch = {'x': jnp.arange(4.0), 'y': jnp.ones(4),
    ...          'mask': jnp.array([1.0, 0.0, 1.0, 1.0])}
    >>> fn = oa.value_and_grad(loss_fn, num_microbatches=2,
    ...                        num_tokens_fn=lambda mb: mb['mask'].sum())
    >>> fn(jnp.float32(1.0), batch)
    (Array(2., dtype=float32), Array(5.3333335, dtype=float32))
    >>> jax.value_and_grad(loss_fn)(jnp.float32(1.0), batch)  # the full batch
    (Array(2., dtype=float32), Array(5.3333335, dtype=float32))
  """
  num_microbatches = validation.check_positive_int(
      "num_microbatches", num_microbatches)
  has_aux = validation.check_bool("has_aux", has_aux)
  has_state = validation.check_bool("has_state", has_state)
  opts = loop_lib.Options(
      num_microbatches=num_microbatches,
      num_tokens_fn=token_weighting.count_fn(
          "oa.value_and_grad",
          validation.check_optional_callable("num_tokens_fn", num_tokens_fn),
          validation.check_bool("equal_weights", equal_weights),
      ),
      loss_reduction=validation.check_loss_reduction(loss_reduction),
      accumulator_dtype=validation.check_accumulator_dtypes(
          accumulator_dtype),
      aux_reduction=aux_reduction_lib.check_aux_reduction(aux_reduction,
                                                          has_aux),
      with_stats=validation.check_bool("with_stats", with_stats),
      grad_reduction=grad_reduction_lib.check_grad_reduction(grad_reduction,
                                                             axis_name),
      has_aux=has_aux,
      has_state=has_state,
      overlap_reduction=validation.check_bool("overlap_reduction",
                                              overlap_reduction),
  )
  settings = runner.Settings(
      axis_name=validation.check_axis_name(axis_name),
      num_microbatches=num_microbatches,
      batch_axes=batching.check_batch_axes(batch_axes),
      param_specs=fsdp.check_param_specs(param_specs),
      policy=fsdp.policy(gradient_sync, gather_params),
      grad_reduction=opts.grad_reduction,
  )
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  if settings.policy.gradient_sync == names.DEFERRED and opts.with_stats:
    raise ValueError(
        "with_stats=True needs the reduced gradient's norm, which"
        " gradient_sync='deferred' does not compute: use one or the other."
    )
  loss = loss_signature.normalize(loss_fn, has_aux, has_state)
  program = loop_program.program(loss, opts)

  declared = loss_signature.keyword_names(loss_fn)

  @functools.wraps(loss_fn)
  def fn(params, *rest, rng=None, num_real_microbatches=None, **kwargs):
    validation.refuse_near_misses(kwargs, ("num_real_microbatches",),
                                  "the value_and_grad call", "loss_fn",
                                  declared)
    loss_signature.check_params(params)
    model_state, batch, args = loss_signature.split_call_args(
        rest, has_state)
    inputs = loss_signature.Inputs(
        model_state, batch, args, kwargs, rng_lib.check_rng(rng),
        trip_count.check_num_real(num_real_microbatches, opts.num_microbatches))
    result = runner.run(program, settings, params, inputs)
    result = result._replace(aux=aux_reduction_lib.merge(result.aux))
    value, grads = loss_signature.pack(result, has_aux, has_state)
    if opts.with_stats:
      return value, grads, result.stats
    return value, grads

  return fn
