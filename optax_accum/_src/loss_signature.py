"""How ``oa.value_and_grad`` calls ``loss_fn``, and shapes what it returns.

The user's ``loss_fn`` takes ``(params, microbatch, *args, **kwargs)`` (with
``has_state``, ``(params, model_state, microbatch, ...)``), plus ``rng=`` when
the caller gave a key, and returns a loss, ``(loss, aux)``, ``(loss,
model_state)`` or ``(loss, (model_state, aux))``. The loop sees one shape:
``f(params, model_state, microbatch, inputs, rng) -> (loss, (state, aux))``,
with None for the missing parts; the caller gets :func:`jax.value_and_grad`'s.
"""

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp


class Inputs(NamedTuple):
  """One call's inputs after ``params``, as the loop reads them."""

  model_state: Any  # threaded model state, or None.
  batch: Any  # split into micro-batches along batch_axes.
  args: tuple[Any, ...]  # passed whole to every micro-batch.
  kwargs: dict[str, Any]  # passed whole to every micro-batch.
  rng: Any  # a PRNG key or None: one key per micro-batch derived from it.
  num_real: Any = None  # int32 scalar: micro-batches to run; None: all.


def _describe(x: Any) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"a single array of dtype {x.dtype} and shape {tuple(x.shape)}"
  return type(x).__name__


def _scalar(loss: Any) -> Any:
  """``loss``, or a clear error if it is not a scalar."""
  if jnp.ndim(loss) != 0:
    raise ValueError(
        "loss_fn must return a scalar loss (a mean or sum over its"
        f" micro-batch), got shape {jnp.shape(loss)}."
    )
  return loss


def normalize(loss_fn, has_aux, has_state):
  """``loss_fn`` in the loop's one shape.

  That is ``f(params, model_state, microbatch, inputs, rng) -> (loss,
  (model_state, aux))``, missing parts as None.
  """

  @functools.wraps(loss_fn)
  def normalized(params, model_state, microbatch, inputs, rng):
    kwargs = inputs.kwargs if rng is None else {**inputs.kwargs, "rng": rng}
    if has_state:
      out = loss_fn(params, model_state, microbatch, *inputs.args, **kwargs)
    else:
      out = loss_fn(params, microbatch, *inputs.args, **kwargs)
    if not (has_aux or has_state):
      return _scalar(out), (None, None)
    if not isinstance(out, tuple) or len(out) != 2:
      raise ValueError(
          "loss_fn must return a pair (loss, aux) with has_aux=True or"
          f" has_state=True, got {_describe(out)}."
      )
    loss, rest = out
    loss = _scalar(loss)
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


def split_call_args(rest, has_state):
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


def pack(result: Any, has_aux: bool, has_state: bool):
  """The caller's output, shaped like :func:`jax.value_and_grad`'s.

  ``result`` has fields ``loss``, ``grads``, ``model_state`` and ``aux``.
  """
  aux = result.aux
  if has_state and has_aux:
    value = (result.loss, (result.model_state, aux))
  elif has_state:
    value = (result.loss, result.model_state)
  elif has_aux:
    value = (result.loss, aux)
  else:
    value = result.loss
  return value, result.grads


