"""The micro-batch loop: a full batch's exact gradient, by micro-batch."""

from collections.abc import Callable
import functools
from typing import Any

import jax.numpy as jnp

from optax_accum._src import aux_reduction as aux_reduction_lib
from optax_accum._src import batching
from optax_accum._src import fsdp
from optax_accum._src import grad_reduction as grad_reduction_lib
from optax_accum._src import loss_signature
from optax_accum._src import microbatch_loop as loop_lib
from optax_accum._src import microbatch_rng
from optax_accum._src import runner
from optax_accum._src import token_weighting
from optax_accum._src import validation


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
    accumulator_dtype: Any = jnp.float32,
    batch_axes: Any = 0,
    aux_reduction: Any = "stack",
    with_stats: bool = False,
    gradient_sync: str = "once",
    gather_params: str = "once",
    param_specs: Any = None,
    grad_reduction: Any = "mean",
) -> Callable[..., Any]:
  r"""Like :func:`jax.value_and_grad`, over a batch split into micro-batches.

  The batch is split along its leading axis (``batch_axes``) into
  ``num_microbatches`` equal micro-batches and a :func:`jax.lax.scan` computes
  one micro-batch's loss and gradient at a time, so that only one
  micro-batch's activations are alive at once. With ``n_i =
  num_tokens_fn(microbatch_i)`` and ``loss_reduction="mean"`` (``loss_fn``
  returns a mean ``L_i`` over ``n_i`` items) the result is the full batch's
  token-weighted mean

  .. math::
    L = \frac{\sum_i n_i L_i}{\sum_i n_i}, \qquad
    \nabla L = \frac{\sum_i n_i \nabla L_i}{\sum_i n_i},

  exactly (to float rounding), however unevenly the tokens fall into
  micro-batches; with ``"sum"`` (``loss_fn`` returns a sum ``S_i``) it is
  :math:`\sum_i S_i / \sum_i n_i`. Without ``num_tokens_fn`` every micro-batch
  counts as one token, and the first trace warns unless ``equal_weights``
  says that is meant. Sums are kept in ``accumulator_dtype``; the gradient
  comes back in the parameters' dtype and the loss in the dtype ``loss_fn``
  returns (bfloat16 stays bfloat16, as with :func:`jax.value_and_grad`). A
  micro-batch with no tokens adds
  nothing (its loss and gradient are not looked at), and a batch with no
  tokens gives a zero loss and zero gradient, not NaN. These are the rules
  of :func:`optax_accum.accumulate` too.

  Model state such as BatchNorm's ``batch_stats`` is threaded through the
  micro-batches with ``has_state=True``: ``loss_fn`` then takes the state after
  ``params`` and returns it updated next to the loss; micro-batch ``i`` sees the
  state that micro-batch ``i - 1`` produced and the final state is returned.

  Randomness: ``fn(..., rng=key)`` gives micro-batch ``i`` its own key,
  ``jax.random.fold_in(key, i)`` (where ``loss_fn`` sees one device's slice,
  inside shard_map or pmap or with Auto axes, the device's index along the
  axis is folded in first: ``fold_in(fold_in(key, lax.axis_index(
  axis_name)), i)``), passed to ``loss_fn`` as ``rng=`` (without ``rng``,
  none is passed): each micro-batch draws its own dropout mask.

  Micro-batch ``i`` is the ``i``-th of ``k`` contiguous blocks of each
  device's rows along each leaf's batch axis: on one device rows ``[i * B //
  k, (i + 1) * B // k)``. Under :func:`jax.set_mesh` with Auto axes and no
  ``axis_name`` (where XLA decides how the batch is sharded) it is rows ``i,
  i + k, i + 2k, ...`` instead, so that XLA does not reshard it.

  Under :func:`jax.jit` with a batch sharded over Explicit mesh axes (the
  data axes, read off its type: ``axis_name`` may be omitted, and is checked
  when given), ``loss_fn`` runs as ``jax.jit(jax.value_and_grad(loss_fn))``
  runs it, on the global micro-batch (``B / k`` rows, still sharded over the
  data axes; annotations that name them work). The parameters are typed
  ``reduced`` over the data axes, so that each micro-batch's gradient is
  ``unreduced``; the loop carries those partial sums and reduces them once,
  after it, back to the parameters' sharding (FSDP: gathered once before,
  reduce-scattered once after). Parameters that JAX cannot type reduced
  (used elementwise with batch-sharded activations: ``x + bias``) stay
  replicated and are reduced in every micro-batch, exact; the first trace
  warns, and :func:`optax_accum.sharding_report` lists them. Axes the batch
  is not sharded over belong to the model.

  Inside :func:`jax.shard_map` or :func:`jax.pmap` ``axis_name`` names the
  manual axis and ``batch`` is this device's shard; under :func:`jax.jit`
  with Auto axes it names a mesh axis over which the batch is sharded and the
  loop runs in a :func:`jax.shard_map` over it, ``loss_fn`` seeing one
  device's slice (the global batch size must be divisible by
  ``num_microbatches`` times the axis size). In these forms the partial sums
  stay on each device through the loop and are summed over the axis once,
  after it; parameters sharded over the axis (``param_specs``) are
  all-gathered once before the loop and their gradients reduce-scattered
  after it, ``gradient_sync`` and ``gather_params`` trading that
  communication for memory. A stacked ``aux`` leaf comes back concatenated
  over devices along its first axis after the micro-batch axis (a scalar
  becomes one entry per device); ``*args``, ``**kwargs``, ``rng`` and batch
  leaves with ``batch_axes`` None are replicated. With ``has_state``, the
  floating leaves of the model state are averaged over the axis after the
  loop, and the others (a PRNG key, a counter) are the first device's.

  Args:
    loss_fn: ``loss_fn(params, microbatch, *args, **kwargs)`` returning a
      scalar loss, or ``(loss, aux)`` with ``has_aux``. With ``has_state`` it
      is ``loss_fn(params, model_state, microbatch, *args, **kwargs)``
      returning ``(loss, new_model_state)``, or ``(loss, (new_model_state,
      aux))``. It also takes ``rng=`` when ``fn`` is called with a key.
    num_microbatches: how many micro-batches to split the batch into.
    has_aux: whether ``loss_fn`` returns auxiliary data, reduced over the
      micro-batches as ``aux_reduction`` says.
    has_state: whether ``loss_fn`` threads model state (see above).
    num_tokens_fn: maps a micro-batch to its scalar weight, e.g. its number of
      unmasked tokens. None weighs every micro-batch the same, with a
      ``UserWarning`` at the first trace unless ``equal_weights``.
    equal_weights: True says that every micro-batch is meant to weigh the
      same (they hold the same number of tokens), without ``num_tokens_fn``
      and without the warning.
    loss_reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over the
      ``num_tokens_fn(microbatch)`` items of its micro-batch.
    axis_name: data-parallel axis (or axes) to sum over once after the loop:
      a manual axis (shard_map, pmap) or an axis of the current mesh (jit;
      optional with Explicit axes, where the batch's sharding says it).
    accumulator_dtype: floating dtype of the running sums, or a pytree
      prefix of the parameters of such dtypes (one per parameter subtree:
      e.g. bfloat16 for a huge embedding); the loss's and aux's sums are then
      float32.
    batch_axes: the axis of each batch leaf to split into micro-batches: an
      int, None, or a pytree prefix of ``batch`` of those (like
      :func:`jax.vmap`'s ``in_axes``). None passes the leaf whole to every
      micro-batch (a scalar, a per-batch table). Errors name the leaf.
    aux_reduction: ``"stack"`` (one entry per micro-batch along a new
      leading axis, in order), ``"mean"`` (weighted by the micro-batches'
      token counts: a per-token metric such as accuracy comes back as the
      full batch's; 0 without tokens), ``"sum"``, ``"max"``, ``"min"``, or a
      pytree prefix of ``aux`` of those; reduced in the loop's carry and,
      with ``axis_name``, over the devices once after the loop.
    with_stats: if True, ``fn`` also returns an :class:`optax_accum.GradStats`
      estimated from the micro-batch gradients (the gradient noise scale:
      see :func:`optax_accum.grad_stats`), at the cost of one squared norm per
      micro-batch and, with ``axis_name``, two scalars in the one reduction.
    gradient_sync: for parameters sharded over ``axis_name`` (FSDP),
      ``"once"`` keeps a whole-size partial gradient sum per device and
      reduce-scatters it after the loop; ``"every_microbatch"`` reduce-scatters
      each micro-batch's gradient into a sum sharded like the parameters (in
      ``accumulator_dtype``): 1/N of the gradient memory, ``k`` times the
      reduce-scatters. Replicated parameters are summed once either way.
      ``"deferred"`` sums nothing over the axis but scalars: the gradient
      comes back as each device's partial (reduce-scattered over the axes
      that shard its parameter), typed unreduced over the other data axes
      under jit (``P("fsdp", unreduced={"replica"})``; Explicit axes
      spanning the whole mesh), device-local inside shard_map; its sum over
      the devices is the batch's gradient. Hand it to
      :func:`optax_accum.accumulate` ``(..., axis_name=...)``, which reduces
      once per update: one jit call per micro-batch, like PyTorch DDP's
      ``no_sync``. The loss comes back reduced; ``with_stats`` is refused.
    gather_params: for parameters sharded over ``axis_name``, ``"once"``
      all-gathers them before the loop and holds them whole through it;
      ``"every_microbatch"`` holds the shards and all-gathers them inside the
      loop, for each micro-batch (``k`` times the all-gathers). On CPU a
      gathered layer stays alive from its forward to its backward use within
      a micro-batch, so the saving is smaller than 1/N of the parameters (see
      ``docs/distributed.md``).
    param_specs: the parameters' :class:`jax.sharding.PartitionSpec` (one,
      or a tree prefix of the parameters, like :func:`jax.shard_map`'s
      ``in_specs``): inside shard_map, how the parameters it passes in are
      sharded (None: replicated); under jit with a mesh, how to shard them
      over ``axis_name`` (None: read off their types, which only Explicit
      axes carry). Only the entries over ``axis_name`` matter.
    grad_reduction: how each gradient leaf is reduced over micro-batches:
      ``"mean"`` (the token-weighted mean above), ``"max"`` (the maximum over
      the micro-batches with tokens, and over devices with ``axis_name``:
      FP8 amax histories and scales), ``"last"`` (the last micro-batch with
      tokens; not with ``axis_name``), or a pytree prefix of the parameters
      of those. A "max" or "last" leaf takes the raw gradient (neither
      weighted nor divided by the token count) and is zero if no micro-batch
      has tokens. For FP8 (``flax.linen.fp8_ops``) use
      ``loss_reduction="sum"``: see ``docs/fp8.md``.

  A variable batch without recompiling: ``fn(..., num_real_microbatches=n)``
  computes only the first ``n`` micro-batches (the loop is then an XLA while
  loop with ``n`` as its trip count, so the others cost nothing): value,
  gradient, aux, model state and keys are those of these ``n`` (stacked aux
  holds zeros past them). ``n`` may be traced: another ``n`` reuses the
  compiled program. A concrete ``n`` outside ``[1, num_microbatches]``
  raises ``ValueError``; a traced one is clamped into that range. With
  ``axis_name`` it must be the same on every device.

  Returns:
    A function ``fn(params, batch, *args, rng=None,
    num_real_microbatches=None, **kwargs)``
    (``fn(params, model_state, batch, ...)`` with ``has_state``) returning
    ``(loss, grads)``; with ``has_aux``, ``((loss, aux), grads)``; with
    ``has_state``, ``((loss, model_state), grads)``, or ``((loss,
    (model_state, aux)), grads)`` with both; with ``with_stats``, the
    stats come third: ``(value, grads, stats)``.

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

    Dropout with a key per micro-batch, and a metric that is the full
    batch's: 2 of its 3 unmasked rows are hits (the mean of the micro-batches'
    hit rates, 1/1 and 1/2, would be 0.75):

    >>> def dropout_loss(w, mb, *, rng):
    ...   keep = jax.random.bernoulli(rng, 0.5, mb['x'].shape)
    ...   x = jnp.where(keep, 2 * mb['x'], 0.0)
    ...   err = mb['mask'] * (x * w - mb['y']) ** 2
    ...   n = jnp.maximum(mb['mask'].sum(), 1)
    ...   hit = (mb['mask'] * ((mb['y'] - mb['x'] * w) ** 2 < 1.5)).sum() / n
    ...   return err.sum() / n, {'hit': hit}
    >>> fn = oa.value_and_grad(dropout_loss, num_microbatches=2, has_aux=True,
    ...                        num_tokens_fn=lambda mb: mb['mask'].sum(),
    ...                        aux_reduction='mean')
    >>> (loss, aux), grad = fn(jnp.float32(1.0), batch, rng=jax.random.key(0))
    >>> aux['hit']
    Array(0.6666667, dtype=float32)
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
      aux_reduction=aux_reduction_lib.check(aux_reduction, has_aux),
      with_stats=validation.check_bool("with_stats", with_stats),
      grad_reduction=grad_reduction_lib.check(grad_reduction, axis_name),
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
  if settings.policy.gradient_sync == fsdp.DEFERRED and opts.with_stats:
    raise ValueError(
        "with_stats=True needs the reduced gradient's norm, which"
        " gradient_sync='deferred' does not compute: use one or the other."
    )
  loss = loss_signature.normalize(loss_fn, has_aux, has_state)
  program = loop_lib.program(loss, opts)

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
        model_state, batch, args, kwargs, microbatch_rng.check(rng),
        loop_lib.check_num_real(num_real_microbatches, opts.num_microbatches))
    result = runner.run(program, settings, params, inputs)
    result = result._replace(aux=aux_reduction_lib.merge(result.aux))
    value, grads = loss_signature.pack(result, has_aux, has_state)
    if opts.with_stats:
      return value, grads, result.stats
    return value, grads

  return fn
