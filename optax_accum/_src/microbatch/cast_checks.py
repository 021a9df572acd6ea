"""Casts to ``unreduced`` that JAX accepts and XLA compiles wrongly.

The typed loop casts parameters to ``reduced``; autodiff then writes casts
of their cotangents to ``unreduced``. Two such casts are accepted by JAX at
trace time and compiled wrongly by XLA (silently wrong gradients, or a
process abort). :func:`check_casts` walks a traced jaxpr and raises
:class:`UnsafeCast` on either, before XLA sees it; the typed layout then
keeps the parameter replicated (``reduced_fallbacks.find``). Each is a
workaround whose docstring says when to remove it.
"""

from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

from optax_accum._src.mesh import readers


class UnsafeCast(TypeError):
  """A cast that JAX accepts at trace time and XLA gets wrong."""


def _sub_jaxprs(value: Any) -> list[Any]:
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jax.extend.core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for v in value for j in _sub_jaxprs(v)]
  return []


def _literal(var: Any) -> Any:
  """The value of a jaxpr literal, or None for a variable."""
  return getattr(var, "val", None) if type(var).__name__ == "Literal" else None


def _scattered_dims(eqn: Any) -> tuple[int, ...]:
  """The operand dimensions a scatter-add indexes into (its rows)."""
  numbers = eqn.params.get("dimension_numbers")
  return tuple(getattr(numbers, "scatter_dims_to_operand_dims", ()) or ())


def _resharded_rows(producer: Any, source: Any, target: Any) -> bool:
  """Whether a scatter-add's rows get a new sharding in ``target``."""
  if producer is None or producer.primitive.name not in (
      "scatter-add", "scatter_add"):
    return False
  old = readers.partitions(readers.full_spec(source))
  new = readers.partitions(readers.full_spec(target))
  return any(d < len(new) and new[d] is not None
             and (d >= len(old) or old[d] != new[d])
             for d in _scattered_dims(producer))


def _unsafe(source: Any, target: Any) -> UnsafeCast:
  return UnsafeCast(
      f"a reshard from {source} to {target} would not compile right")


def refuse_constant_unreduced_cast(var: Any, source: Any,
                                   target: Any) -> None:
  """Workaround: XLA compiles a non-zero constant cast to ``unreduced`` as
  the value on every device, so that the sum counts it once per device.
  Remove when a reshard of a constant to unreduced compiles to its value on
  one device and zeros on the others (then
  ``tests/forms/test_typed_form.py::test_a_parameter_outside_the_batch_path_is_kept_replicated_and_exact``
  passes with this check removed: seen on jax 0.9.1 and 0.10.2).

  Autodiff writes such a cast where a reduced parameter reaches the loss
  other than through the batch (``scale * mean(...)``: the loss is then
  typed reduced and the seed cotangent 1.0 is cast): silently wrong
  gradients. Raises :class:`UnsafeCast` on it.
  """
  constant = _literal(var)
  if constant is not None and bool(jnp.any(jnp.asarray(constant))):
    raise _unsafe(source, target)


def refuse_resharded_scatter_rows(producer: Any, source: Any,
                                  target: Any) -> None:
  """Workaround: Shardy aborts the process on a cast to ``unreduced`` of a
  scatter-add's result that shards its rows anew ("the result has unreduced
  axes while the operand has incompatible sharding along reduction
  factors"). Remove when Shardy partitions it (then
  ``tests/forms/test_typed_form.py::test_a_cast_that_xla_aborts_on_is_kept_replicated``
  passes with this check removed: seen on jax 0.9.1 and 0.10.2).

  The cast is the cotangent of a gather from a table sharded over a model
  axis along its rows, read with an ``out_sharding`` that drops the batch
  axes. Raises :class:`UnsafeCast` on it.
  """
  if _resharded_rows(producer, source, target):
    raise _unsafe(source, target)


def check_casts(jaxpr: Any) -> None:
  """Raises :class:`UnsafeCast` where XLA would compile a cast wrongly.

  Runs the workarounds on every reshard of ``jaxpr`` (and its sub-jaxprs)
  that makes a value ``unreduced``: :func:`refuse_constant_unreduced_cast`
  and :func:`refuse_resharded_scatter_rows`. JAX accepts both casts.
  """
  producers = {}
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      producers[id(var)] = eqn
    if eqn.primitive.name == "reshard":
      var = eqn.invars[0]
      source, target = var.aval, eqn.outvars[0].aval
      if (readers.unreduced_axes(target)
          and not readers.unreduced_axes(source)):
        refuse_constant_unreduced_cast(var, source, target)
        refuse_resharded_scatter_rows(producers.get(id(var)), source, target)
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        check_casts(sub)
