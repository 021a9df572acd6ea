"""What a micro-step hands :func:`optax_accum.accumulate`: its gradients.

optax accepts gradient leaves that are Python scalars or NumPy arrays; a
micro-step's gradients are checked against the state (structure, shapes,
device-locality under ``axis_name``) and made floating, so that the running
sum and its mean keep the parameters' kind of number.
"""

import jax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.accumulate import unreduced_sums


def checked_grads(updates, grad_sum, axis_name, num_tokens):
  """The incoming gradients as floating arrays, checked against the state.

  A micro-step known at trace time to have no tokens (a flush:
  ``num_tokens=0``) is never looked at, so its zeros need not be
  device-local.
  """
  updates = validation.check_grads(updates, grad_sum, axis_name,
                                   check_local=not _no_tokens(num_tokens))
  return as_inexact(updates, grad_sum)


def checked_partials(updates, grad_sum, axis_name, num_tokens):
  """Unreduced gradients under jit (each device's partial), checked.

  Each leaf must be unreduced over the axes of its per-device slots; see
  :func:`unreduced_sums.check_grads`.
  """
  expected = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(jnp.shape(s)[1:], s.dtype), grad_sum
  )
  validation.check_same_structure(
      "updates", updates, expected, "the params the state was built for"
  )
  updates = jax.tree.map(jnp.asarray, updates)
  unreduced_sums.check_grads(updates, grad_sum, axis_name,
                             looked_at=not _no_tokens(num_tokens))
  return as_inexact(updates, grad_sum)


def _no_tokens(num_tokens):
  """Whether the micro-step is known at trace time to have no tokens."""
  return num_tokens is not None and not isinstance(
      num_tokens, jax.core.Tracer) and float(num_tokens) == 0


def sum_dtype(param, accumulator_dtype):
  """The running sum's dtype: complex parameters get a complex sum."""
  if jnp.iscomplexobj(param):
    return jnp.result_type(accumulator_dtype, jnp.complex64)
  return accumulator_dtype


def as_inexact(grads, grad_sum):
  """Gradients as floating (or complex) arrays, checked against the sum.

  Integer and bool leaves (a Python ``0`` for an unused parameter) take the
  sum's dtype, so that their mean is not rounded to an integer. A complex
  gradient for a real sum would lose its imaginary part: refused.
  """

  def convert(path, g, s):
    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(s):
      raise TypeError(
          f"updates{jax.tree_util.keystr(path)} is complex ({g.dtype}) but"
          f" the parameters it is for are real (the sum is {s.dtype}): its"
          " imaginary part would be lost. Initialise with complex"
          " parameters."
      )
    if jnp.issubdtype(g.dtype, jnp.inexact):
      return g
    return g.astype(s.dtype)

  return jax.tree_util.tree_map_with_path(convert, grads, grad_sum)
