"""The micro-batch loop: a full batch's exact gradient, one micro-batch at a time."""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import distributed
from optax_accum._src import validation


def split_microbatches(batch: Any, num_microbatches: int) -> Any:
  """Reshapes each leaf ``(B, ...)`` into ``(num_microbatches, B // k, ...)``.

  Micro-batch ``i`` holds rows ``[i * B // k, (i + 1) * B // k)``. The reshape
  is free in XLA: no copy of the batch is made.

  Args:
    batch: a pytree of arrays sharing a leading batch axis.
    num_microbatches: the number ``k`` of micro-batches.

  Returns:
    The batch with a new leading micro-batch axis.
  """
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError("batch must contain at least one array, got an empty tree.")
  sizes = {}
  for path, leaf in leaves:
    if jnp.ndim(leaf) == 0:
      raise ValueError(
          f"batch{jax.tree_util.keystr(path)} is a scalar; every batch leaf"
          " needs a leading batch axis to split into micro-batches."
      )
    sizes[jax.tree_util.keystr(path)] = jnp.shape(leaf)[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        "batch leaves must share a leading batch size, got sizes"
        f" {sizes}."
    )
  batch_size = next(iter(sizes.values()))
  if batch_size % num_microbatches:
    raise ValueError(
        f"The batch size {batch_size} (leading axis of every batch leaf) must"
        f" be divisible by num_microbatches={num_microbatches}."
    )
  size = batch_size // num_microbatches
  return jax.tree.map(
      lambda x: jnp.reshape(x, (num_microbatches, size) + jnp.shape(x)[1:]),
      batch,
  )


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
  comes back in the parameters' dtype. A batch with no tokens gives a zero loss
  and zero gradient, not NaN.

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
  num_microbatches = validation.check_positive_int(
      "num_microbatches", num_microbatches
  )
  has_aux = validation.check_bool("has_aux", has_aux)
  has_state = validation.check_bool("has_state", has_state)
  loss_reduction = validation.check_loss_reduction(loss_reduction)
  axis_name = validation.check_axis_name(axis_name)
  accumulator_dtype = validation.check_accumulator_dtype(accumulator_dtype)
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {loss_fn!r}.")
  if num_tokens_fn is not None and not callable(num_tokens_fn):
    raise TypeError(
        f"num_tokens_fn must be None or callable, got {num_tokens_fn!r}."
    )

  def microbatch_value_and_grad(params, model_state, microbatch, args):
    """One micro-batch's (loss, new model state, aux) and gradient."""

    def loss_and_rest(p):
      if has_state:
        out = loss_fn(p, model_state, microbatch, *args)
      else:
        out = loss_fn(p, microbatch, *args)
      if not (has_aux or has_state):
        return out, (None, None)
      if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(
            "loss_fn must return a pair (loss, aux) with has_aux=True or"
            f" has_state=True, got {type(out).__name__}."
        )
      loss, rest = out
      if has_state and has_aux:
        if not isinstance(rest, tuple) or len(rest) != 2:
          raise ValueError(
              "With has_state=True and has_aux=True, loss_fn must return"
              " (loss, (new_model_state, aux))."
          )
        return loss, rest
      return loss, (rest, None) if has_state else (None, rest)

    (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(
        params
    )
    if jnp.ndim(loss) != 0:
      raise ValueError(
          f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}."
      )
    return loss, rest, grads

  def token_weight(microbatch):
    if num_tokens_fn is None:
      return jnp.ones([], jnp.float32)
    return validation.as_token_count(
        "num_tokens_fn(microbatch)", num_tokens_fn(microbatch)
    )

  def loop(params, model_state, batch, args):
    """The scan: this device's sums over its micro-batches."""
    microbatches = split_microbatches(batch, num_microbatches)

    def step(carry, microbatch):
      grad_sum, loss_sum, token_sum, model_state = carry
      loss, (new_model_state, aux), grads = microbatch_value_and_grad(
          params, model_state, microbatch, args
      )
      tokens = token_weight(microbatch)
      weight = tokens if loss_reduction == "mean" else jnp.float32(1)
      # A micro-batch without tokens adds nothing, even if its mean is 0/0.
      keep = tokens != 0
      grad_sum = jax.tree.map(
          lambda acc, g: acc
          + jnp.where(keep, weight.astype(acc.dtype) * g.astype(acc.dtype), 0),
          grad_sum,
          grads,
      )
      loss_sum = loss_sum + jnp.where(
          keep, weight.astype(loss_sum.dtype) * loss.astype(loss_sum.dtype), 0
      )
      return (grad_sum, loss_sum, token_sum + tokens, new_model_state), aux

    init = (
        jax.tree.map(
            lambda p: jnp.zeros_like(p, dtype=accumulator_dtype), params
        ),
        jnp.zeros([], accumulator_dtype),
        jnp.zeros([], jnp.float32),
    )
    if axis_name is not None:
      # The carry holds this device's partial sums: they differ by device.
      init = distributed.device_local(init, axis_name)
    (grad_sum, loss_sum, token_sum, model_state), aux = lax.scan(
        step, init + (model_state,), microbatches
    )
    return grad_sum, loss_sum, token_sum, model_state, aux

  def mean_of(grad_sum, loss_sum, token_sum, params):
    safe_count = jnp.where(token_sum > 0, token_sum, 1.0)
    grads = jax.tree.map(
        lambda s, p: (s / safe_count.astype(s.dtype)).astype(jnp.result_type(p)),
        grad_sum,
        params,
    )
    loss = (loss_sum / safe_count.astype(loss_sum.dtype)).astype(jnp.float32)
    return loss, grads

  def data_parallel(params, model_state, batch, args, param_specs=None):
    """Inside shard_map or pmap: local sums, then one reduction over the axis.

    Parameters that ``param_specs`` shard over the axis (FSDP) are gathered
    once, before the loop; their gradients are reduce-scattered back into
    shards after it.
    """
    if param_specs is None:
      param_specs = jax.tree.map(lambda _: P(), params)
    full_params = jax.tree.map(distributed.gather, params, param_specs)
    # Differentiate with respect to this device's copy of the parameters, so
    # that autodiff does not sum gradients over the axis on every micro-step.
    local_params = distributed.device_local(full_params, axis_name)
    if model_state is not None:
      model_state = distributed.floats_device_local(model_state, axis_name)
    grad_sum, loss_sum, token_sum, model_state, aux = loop(
        local_params, model_state, batch, args
    )
    grad_sum, (loss_sum, token_sum) = distributed.sum_into_shards(
        grad_sum, param_specs, (loss_sum, token_sum), axis_name
    )
    if model_state is not None:
      model_state = distributed.mean_of_floats(model_state, axis_name)
    loss, grads = mean_of(grad_sum, loss_sum, token_sum, params)
    return loss, grads, model_state, aux

  def fn(params, *rest):
    if has_state:
      if len(rest) < 2:
        raise TypeError(
            "With has_state=True call fn(params, model_state, batch, *args)."
        )
      model_state, batch, *args = rest
    else:
      if not rest:
        raise TypeError("Call fn(params, batch, *args).")
      model_state = None
      batch, *args = rest
    if axis_name is None:
      grad_sum, loss_sum, token_sum, model_state, aux = loop(
          params, model_state, batch, args
      )
      loss, grads = mean_of(grad_sum, loss_sum, token_sum, params)
    elif distributed.is_bound(axis_name):
      loss, grads, model_state, aux = data_parallel(
          params, model_state, batch, args
      )
    else:
      loss, grads, model_state, aux = distributed.over_mesh(
          data_parallel, axis_name, num_microbatches, params, model_state,
          batch, args,
      )
    if has_state and has_aux:
      return (loss, (model_state, aux)), grads
    if has_state:
      return (loss, model_state), grads
    if has_aux:
      return (loss, aux), grads
    return loss, grads

  return fn
