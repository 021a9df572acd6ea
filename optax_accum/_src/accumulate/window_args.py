"""What flows beside the gradient: ``update``'s extra arguments over a window.

``inner`` runs once per window, on the emitting call, but a full-batch loop
would have handed it arguments computed from the whole batch. Each extra
argument therefore has a rule for the window:

* ``value`` (a loss, for ``optax.contrib.reduce_on_plateau`` or a line
  search): the window's token-weighted mean of the values passed, with the
  weights of the gradient (a micro-step that is skipped, dropped or has no
  tokens adds nothing). Each call adds ``weight * value`` to a running sum
  and its tokens to a running count (:class:`ValueSums`, per device where the
  token count is); the emitting branch reduces them with the gradient's sums
  and divides. With ``loss_reduction="sum"`` this is the window's per-token
  mean loss, the value that matches the mean gradient ``inner`` gets.
* ``grad`` (a line search's gradient at ``params``): the window's mean
  gradient, the one ``inner`` gets as its updates.
* ``value_fn`` (a line search's loss at other parameters): a function of the
  parameters that cannot be summed over micro-steps. Refused, unless the
  transformation was built with ``value_fn_over_window=True`` (the caller
  says it evaluates the whole window's loss); then it is passed as given on
  the emitting call.
* any other: passed to ``inner`` as given on the emitting call.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

VALUE = "value"
GRAD = "grad"
VALUE_FN = "value_fn"

class ValueSums(NamedTuple):
  """The running sums behind the window's ``value`` (per device with an
  axis, like the token count)."""

  total: jax.Array  # shape=() or (slots,): the sum of weight * value.
  tokens: jax.Array  # shape=() or (slots,), float32: their tokens.


def zeros(make) -> ValueSums:
  """Empty sums; ``make(dtype)`` makes one scalar (with slots if need be).

  The total is float64 under ``jax_enable_x64`` (a float64 loss is not
  rounded to float32), float32 otherwise.
  """
  return ValueSums(make(jax.dtypes.canonicalize_dtype(jnp.float64)),
                   make(jnp.float32))


def value_fn_error() -> ValueError:
  return ValueError(
      "oa.accumulate got value_fn= in update: inner runs once per window,"
      " and a value_fn built from one micro-batch would give a line search"
      " that micro-batch's loss, not the window's. Either take the whole"
      " batch's loss and gradient in one call, loss, grads ="
      " oa.value_and_grad(loss_fn, num_microbatches=k)(params, batch), and"
      " call the line search's optimizer directly with value=loss,"
      " grad=grads and a value_fn over the whole batch (the one-call"
      " recipe); or, if your value_fn already evaluates the whole window's"
      " loss, build oa.accumulate(..., value_fn_over_window=True)."
  )


def checked_value(extra_args: dict[str, Any],
                  value_fn_over_window: bool) -> jax.Array | None:
  """The call's ``value`` as a real scalar (None without one); refuses a
  ``value_fn`` that was not declared to cover the window."""
  if VALUE_FN in extra_args and not value_fn_over_window:
    raise value_fn_error()
  if VALUE not in extra_args:
    return None
  value = extra_args[VALUE]
  try:
    value = jnp.asarray(value)
  except TypeError as e:
    raise TypeError(
        f"value must be a real scalar (the micro-batch's loss), got"
        f" {value!r}."
    ) from e
  if value.ndim != 0 or not (jnp.issubdtype(value.dtype, jnp.floating)
                             or jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(
        "value must be a real scalar (the micro-batch's loss, which"
        " accumulate averages over the window with the gradient's token"
        f" weights), got {value.dtype}{list(value.shape)}."
    )
  return value


def add(sums: ValueSums, value: jax.Array | None, kept_weight: jax.Array,
        tokens: jax.Array) -> ValueSums:
  """``sums`` with a micro-step's value added.

  ``kept_weight`` is the weight the gradient was added with, zero where the
  micro-step adds nothing (then ``value`` is not looked at: it may be NaN);
  ``tokens`` the tokens it added to the count.
  """
  if value is None:
    return sums
  dtype = sums.total.dtype
  term = jnp.where(kept_weight != 0,
                   kept_weight.astype(dtype) * value.astype(dtype),
                   jnp.zeros([], dtype))
  return ValueSums(sums.total + term.reshape(jnp.shape(sums.total)),
                   sums.tokens + tokens.reshape(jnp.shape(sums.tokens)))


def for_inner(extra_args: dict[str, Any], sums: ValueSums,
              mean_grads: Any) -> dict[str, Any]:
  """The extra arguments ``inner`` gets on emit (``sums`` reduced over the
  devices): ``value`` and ``grad`` as the window's, the others as given."""
  args = dict(extra_args)
  if VALUE in args:
    given = jnp.asarray(args[VALUE]).dtype
    out_dtype = given if jnp.issubdtype(given, jnp.floating) else (
        sums.total.dtype)
    # NaN, visibly, if no micro-step of the window with tokens passed one.
    args[VALUE] = (sums.total / sums.tokens.astype(sums.total.dtype)).astype(
        out_dtype)
  if GRAD in args:
    args[GRAD] = mean_grads
  return args
