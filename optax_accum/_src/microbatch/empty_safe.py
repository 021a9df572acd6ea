"""A micro-batch's value and gradient that differentiate safely when empty.

Where :mod:`borrowing` does not apply, the loop adds each micro-batch as
``where(keep, weight * g, 0)``: an empty micro-batch's mean loss is 0/0 and
its gradient NaN, and the select drops them. That is exact for the value,
but not under a derivative of the loop's results (``jax.grad`` of the loss
``oa.value_and_grad`` returns, a meta-gradient through its gradient): the
select hands the dropped branch a zero cotangent, and the loss's backward
pass multiplies that zero by the 1/0 of its division, NaN (the double-where
trap).

:func:`value_and_grad` is ``jax.value_and_grad(loss, has_aux=True)`` for the
program as it runs. Differentiated, it is the same computation of a loss
whose own derivative is a ``lax.cond`` on ``keep``: an empty micro-batch's
loss and aux have a zero derivative (its model state keeps its own), and no
zero meets an infinity. A conditional transposes only the branch it takes
(batched by ``jax.vmap``, it selects between the branches' results: the
NaN of the one not taken is dropped, not multiplied by zero).
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


def value_and_grad(loss: Callable[..., Any], keep: jax.Array, params: Any,
                   *args: Any) -> Any:
  """``jax.value_and_grad(loss, has_aux=True)(params, *args)``.

  ``loss`` returns ``(value, (model_state, aux))``. Differentiated, where
  the scalar bool ``keep`` is false the value and aux of ``loss`` have no
  derivative (the loop drops them), so that an empty micro-batch's 0/0 adds
  no NaN to the derivative of what the loop returns.
  """
  leaves, treedef = jax.tree.flatten(args)
  arrays = [i for i, x in enumerate(leaves) if is_array(x)]

  def with_arrays(params, values):  # other leaves (a function) stay static.
    full = list(leaves)
    for i, x in zip(arrays, values):
      full[i] = x
    return loss(params, *treedef.unflatten(full))

  values = [leaves[i] for i in arrays]
  fn, consts = jax.closure_convert(with_arrays, params, values)
  return _value_and_grad(fn, keep, params, (values,), consts)


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _value_and_grad(fn, keep, params, args, consts):
  del keep  # the program: the plain derivative, the loop selects.
  return jax.value_and_grad(fn, has_aux=True)(params, *args, *consts)


@_value_and_grad.defjvp
def _value_and_grad_jvp(fn, primals, tangents):
  keep, *rest = primals
  _, *rest_dot = tangents

  def safe(params, args, consts):
    return jax.value_and_grad(
        lambda p: _dropped_if(fn, keep, p, *args, *consts),
        has_aux=True)(params)

  return jax.jvp(safe, tuple(rest), tuple(rest_dot))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _dropped_if(fn, keep, *args):
  del keep
  return fn(*args)


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@_dropped_if.defjvp
def _dropped_if_jvp(fn, primals, tangents):
  keep, *args = primals
  _, *args_dot = tangents
  # Itself dropped: a derivative of this rule's primal meets the same cond.
  out = _dropped_if(fn, keep, *args)
  leaves, treedef = jax.tree.flatten(out)
  floats = [i for i, x in enumerate(leaves) if _is_float(x)]
  # Flat, out is the value, then the model state's leaves, then aux's.
  state = range(1, 1 + len(jax.tree.leaves(out[1][0])))

  def derivative(drop):
    def branch():
      _, out_dot = jax.jvp(fn, tuple(args), tuple(args_dot))
      dots = jax.tree.leaves(out_dot)
      return [dots[i] if not drop or i in state else jnp.zeros_like(dots[i])
              for i in floats]
    return branch

  float_dots = lax.cond(keep, derivative(False), derivative(True))
  dots = [np.zeros(np.shape(x), jax.dtypes.float0) for x in leaves]
  for i, dot in zip(floats, float_dots):
    dots[i] = dot
  return out, treedef.unflatten(dots)
