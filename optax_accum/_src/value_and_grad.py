"""The micro-batch loop: a full batch's exact gradient, one micro-batch at a time."""

from collections.abc import Callable
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import mesh_loop
from optax_accum._src import partial_sums
from optax_accum._src import sharding
from optax_accum._src import token_weighting
from optax_accum._src import validation

# Kept importable from here: the split is part of this module's contract.
split_microbatches = batching.split_microbatches


class _Sums(NamedTuple):
  """The loop's running sums (per device under ``axis_name``)."""

  grads: Any  # like params, dtype=accumulator_dtype.
  loss: jax.Array  # shape=(), dtype=accumulator_dtype.
  tokens: jax.Array  # shape=(), dtype=jnp.float32.


class _Result(NamedTuple):
  """What the loop hands back, before it is packed for the caller."""

  loss: jax.Array
  grads: Any
  model_state: Any
  aux: Any


class _Options(NamedTuple):
  """The validated settings of one :func:`value_and_grad`."""

  num_microbatches: int
  has_aux: bool
  has_state: bool
  num_tokens_fn: Callable[[Any], Any] | None
  loss_reduction: str
  axis_name: axes.AxisName | None
  accumulator_dtype: Any


def _normalize(loss_fn, has_aux, has_state):
  """``loss_fn`` as ``f(params, model_state, mb, args) -> (loss, (state, aux))``.

  Missing parts come back as None, so that the loop has one shape to handle.
  """

  @functools.wraps(loss_fn)
  def normalized(params, model_state, microbatch, args):
    if has_state:
      out = loss_fn(params, model_state, microbatch, *args)
    else:
      out = loss_fn(params, microbatch, *args)
    if not (has_aux or has_state):
      return out, (None, None)
    if not isinstance(out, tuple) or len(out) != 2:
      raise ValueError(
          "loss_fn must return a pair (loss, aux) with has_aux=True or"
          f" has_state=True, got {type(out).__name__}."
      )
    loss, rest = out
    if not has_state:
      return loss, (None, rest)
    if not has_aux:
      return loss, (rest, None)
    if not isinstance(rest, tuple) or len(rest) != 2:
      raise ValueError(
          "With has_state=True and has_aux=True, loss_fn must return"
          f" (loss, (new_model_state, aux)), got (loss, {type(rest).__name__})."
      )
    return loss, rest

  return normalized


def _token_count(num_tokens_fn, microbatch):
  if num_tokens_fn is None:
    return jnp.ones([], jnp.float32)
  return validation.as_token_count(
      "num_tokens_fn(microbatch)", num_tokens_fn(microbatch)
  )


def _zero_sums(params, opts: _Options) -> _Sums:
  sums = _Sums(
      # zeros_like keeps each parameter's sharding (model-parallel axes).
      grads=jax.tree.map(
          lambda p: jnp.zeros_like(p, dtype=opts.accumulator_dtype), params
      ),
      loss=jnp.zeros([], opts.accumulator_dtype),
      tokens=jnp.zeros([], jnp.float32),
  )
  if opts.axis_name is not None:
    # The sums are this device's partial sums: they differ by device.
    sums = axes.device_local(sums, opts.axis_name)
  return sums


def _loop(loss, opts: _Options, params, model_state, batch, args):
  """The scan over this device's micro-batches: ``(sums, state, aux)``."""
  microbatches = batching.split_microbatches(batch, opts.num_microbatches)
  value_and_grad_fn = jax.value_and_grad(loss, has_aux=True)

  def step(carry, microbatch):
    sums, model_state = carry
    (value, (model_state, aux)), grads = value_and_grad_fn(
        params, model_state, microbatch, args
    )
    if jnp.ndim(value) != 0:
      raise ValueError(
          f"loss_fn must return a scalar loss, got shape {jnp.shape(value)}."
      )
    c = token_weighting.contribution(
        _token_count(opts.num_tokens_fn, microbatch), opts.loss_reduction
    )
    sums = _Sums(
        grads=token_weighting.add(sums.grads, grads, c),
        loss=sums.loss + token_weighting.weighted(value, c, sums.loss.dtype),
        tokens=sums.tokens + c.tokens,
    )
    return (sums, model_state), aux

  with jax.named_scope("optax_accum_microbatch_loop"):
    (sums, model_state), aux = lax.scan(
        step, (_zero_sums(params, opts), model_state), microbatches
    )
  return sums, model_state, aux


def _means(sums: _Sums, params) -> tuple[jax.Array, Any]:
  """The loss and gradient: the sums divided by the token count."""
  grads = token_weighting.mean(sums.grads, sums.tokens, params)
  loss = token_weighting.mean(sums.loss, sums.tokens, jnp.float32(0))
  return loss, grads


def _single_device(loss, opts, params, model_state, batch, args) -> _Result:
  sums, model_state, aux = _loop(loss, opts, params, model_state, batch, args)
  return _Result(*_means(sums, params), model_state, aux)


def _data_parallel(loss, opts, params, model_state, batch, args,
                   param_specs=None):
  """Inside shard_map or pmap: local sums, then one reduction over the axis.

  Parameters that ``param_specs`` shard over the axis (FSDP) are gathered
  once, before the loop; their gradients are reduce-scattered back into
  shards after it.
  """
  axis_name = opts.axis_name
  if param_specs is None:
    param_specs = jax.tree.map(lambda _: P(), params)
  full_params = jax.tree.map(sharding.gather, params, param_specs)
  # Differentiate with respect to this device's copy of the parameters, so
  # that autodiff does not sum gradients over the axis on every micro-step.
  local_params = axes.device_local(full_params, axis_name)
  if model_state is not None:
    model_state = axes.floats_device_local(model_state, axis_name)
  sums, model_state, aux = _loop(
      loss, opts, local_params, model_state, batch, args
  )
  grads, (loss_sum, tokens) = sharding.sum_into_shards(
      sums.grads, param_specs, (sums.loss, sums.tokens), axis_name
  )
  if model_state is not None:
    model_state = partial_sums.mean_of_floats(model_state, axis_name)
  loss_value, grads = _means(_Sums(grads, loss_sum, tokens), params)
  return _Result(loss_value, grads, model_state, aux)


def _split_call_args(rest, has_state):
  """``(model_state, batch, args)`` from what follows ``params``."""
  if has_state:
    if len(rest) < 2:
      raise TypeError(
          "With has_state=True call fn(params, model_state, batch, *args)."
      )
    model_state, batch, *args = rest
    return model_state, batch, tuple(args)
  if not rest:
    raise TypeError("Call fn(params, batch, *args).")
  batch, *args = rest
  return None, batch, tuple(args)


def _pack(result: _Result, has_aux: bool, has_state: bool):
  """The caller's output, shaped like :func:`jax.value_and_grad`'s."""
  if has_state and has_aux:
    value = (result.loss, (result.model_state, result.aux))
  elif has_state:
    value = (result.loss, result.model_state)
  elif has_aux:
    value = (result.loss, result.aux)
  else:
    value = result.loss
  return value, result.grads


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int,
    has_aux: bool = False,
    has_state: bool = False,
    num_tokens_fn: Callable[[Any], Any] | None = None,
    loss_reduction: str = "mean",
    axis_name: str | tuple[str, ...] | None = None,
    accumulator_dtype: Any = jnp.float32,
) -> Callable[..., Any]:
  r"""Like :func:`jax.value_and_grad`, over a batch split into micro-batches.

  The batch is split along its leading axis into ``num_microbatches`` equal
  micro-batches and a :func:`jax.lax.scan` computes one micro-batch's loss and
  gradient at a time, so that only one micro-batch's activations are alive at
  once. With ``n_i = num_tokens_fn(microbatch_i)`` and ``loss_reduction="mean"``
  (``loss_fn`` returns a mean ``L_i`` over ``n_i`` items) the result is the
  full batch's token-weighted mean

  .. math::
    L = \frac{\sum_i n_i L_i}{\sum_i n_i}, \qquad
    \nabla L = \frac{\sum_i n_i \nabla L_i}{\sum_i n_i},

  exactly (to float rounding), however unevenly the tokens fall into
  micro-batches; with ``"sum"`` (``loss_fn`` returns a sum ``S_i``) it is
  :math:`\sum_i S_i / \sum_i n_i`. Without ``num_tokens_fn`` every micro-batch
  counts as one token. Sums are kept in ``accumulator_dtype``; the gradient
  comes back in the parameters' dtype. A micro-batch with no tokens adds
  nothing (its loss and gradient are not looked at), and a batch with no
  tokens gives a zero loss and zero gradient, not NaN. These are the rules
  of :func:`optax_accum.accumulate` too.

  Model state such as BatchNorm's ``batch_stats`` is threaded through the
  micro-batches with ``has_state=True``: ``loss_fn`` then takes the state after
  ``params`` and returns it updated next to the loss; micro-batch ``i`` sees the
  state that micro-batch ``i - 1`` produced and the final state is returned.

  With ``axis_name`` (data parallelism) the partial sums stay on each device
  through the loop and are summed over the axis once, after it: one reduction
  per call instead of one per micro-batch. Inside :func:`jax.shard_map` or
  :func:`jax.pmap` ``axis_name`` names the manual axis and ``batch`` is this
  device's shard. Under :func:`jax.jit` with a mesh set by
  :func:`jax.set_mesh` (Auto or Explicit axes) it names a mesh axis over which
  the batch is sharded: the loop then runs in a :func:`jax.shard_map` over that
  axis, each device splitting its own shard into micro-batches (micro-batch
  ``i`` is every device's ``i``-th slice; the global batch size must be
  divisible by ``num_microbatches`` times the axis size) and ``loss_fn`` sees
  one device's slice, like under pmap. Parameters sharded over the axis
  (FSDP, Explicit axes) are all-gathered once before the loop and their
  gradients reduce-scattered back to the parameters' sharding after it. In
  that mode an ``aux`` leaf comes back concatenated over devices along its
  first axis after the micro-batch axis (a scalar becomes one entry per
  device). With ``has_state`` and ``axis_name``, the floating leaves of the
  model state are averaged over the axis after the loop.

  Args:
    loss_fn: ``loss_fn(params, microbatch, *args)`` returning a scalar loss, or
      ``(loss, aux)`` with ``has_aux``. With ``has_state`` it is
      ``loss_fn(params, model_state, microbatch, *args)`` returning
      ``(loss, new_model_state)``, or ``(loss, (new_model_state, aux))``.
    num_microbatches: how many micro-batches to split the batch into.
    has_aux: whether ``loss_fn`` returns auxiliary data; it comes back stacked
      along a new leading axis, one entry per micro-batch in order.
    has_state: whether ``loss_fn`` threads model state (see above).
    num_tokens_fn: maps a micro-batch to its scalar weight, e.g. its number of
      unmasked tokens. None weighs every micro-batch the same.
    loss_reduction: ``"mean"`` or ``"sum"``: how ``loss_fn`` reduces over the
      ``num_tokens_fn(microbatch)`` items of its micro-batch.
    axis_name: data-parallel axis (or axes) to sum over once after the loop:
      a manual axis (shard_map, pmap) or an axis of the current mesh (jit).
    accumulator_dtype: floating dtype of the running sums.

  Returns:
    A function ``fn(params, batch, *args)`` (``fn(params, model_state, batch,
    *args)`` with ``has_state``) returning ``(loss, grads)``; with ``has_aux``,
    ``((loss, aux), grads)``; with ``has_state``, ``((loss, model_state),
    grads)``, or ``((loss, (model_state, aux)), grads)`` with both.

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
  opts = _Options(
      num_microbatches=validation.check_positive_int(
          "num_microbatches", num_microbatches
      ),
      has_aux=validation.check_bool("has_aux", has_aux),
      has_state=validation.check_bool("has_state", has_state),
      num_tokens_fn=validation.check_optional_callable(
          "num_tokens_fn", num_tokens_fn
      ),
      loss_reduction=validation.check_loss_reduction(loss_reduction),
      axis_name=validation.check_axis_name(axis_name),
      accumulator_dtype=validation.check_accumulator_dtype(accumulator_dtype),
  )
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  loss = _normalize(loss_fn, opts.has_aux, opts.has_state)

  @functools.wraps(loss_fn)
  def fn(params, *rest):
    model_state, batch, args = _split_call_args(rest, opts.has_state)
    if opts.axis_name is None:
      result = _single_device(loss, opts, params, model_state, batch, args)
    elif axes.is_bound(opts.axis_name):
      result = _data_parallel(loss, opts, params, model_state, batch, args)
    else:
      result = _Result(*mesh_loop.over_mesh(
          functools.partial(_data_parallel, loss, opts), opts.axis_name,
          opts.num_microbatches, params, model_state, batch, args,
      ))
    return _pack(result, opts.has_aux, opts.has_state)

  return fn
