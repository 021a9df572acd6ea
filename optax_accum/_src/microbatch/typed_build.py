"""Building the ``typed`` form's layout: which leaves are typed reduced.

Every floating, summed ("mean") parameter leaf is a candidate to be typed
``reduced`` over the data axes (:mod:`typed_layout`). :func:`build` traces
the call's *local* stage with all of them reduced, once: into a jaxpr
whose casts :func:`reduced_fallbacks.check_casts` checks, then evaluated
in place (re-binding its equations, without running ``loss_fn``'s Python
again), so that a model without fallback leaves costs one trace of
``loss_fn``. If that trace fails, :func:`reduced_fallbacks.find` finds the
leaves that JAX cannot type reduced, which stay replicated.
"""

from collections.abc import Callable
import time
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import reduced_fallbacks
from optax_accum._src.microbatch import stages
from optax_accum._src.microbatch import typed_layout
from optax_accum._src.rules import grad_reduction as grad_reduction_lib


def _targets(params: Any, param_specs: Any,
             axis_name: readers.AxisName) -> list[P]:
  """Each parameter leaf's spec: its type's, over data axes ``param_specs``'."""
  leaves = jax.tree.leaves(params)
  if param_specs is None:
    data_specs = [None] * len(leaves)
  else:
    data_specs = jax.tree.leaves(
        fsdp.specs_like(params, param_specs, axis_name),
        is_leaf=lambda x: isinstance(x, P))
  return [
      typed_layout.merged_spec(readers.full_spec(p), d, axis_name,
                               jnp.ndim(p))
      for p, d in zip(leaves, data_specs)
  ]


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer))


def _traced_once(local: Callable[[], stages.Partials]) -> stages.Partials:
  """``local()``, traced into a jaxpr, its casts checked, then evaluated.

  Raises as the trace does, or :class:`reduced_fallbacks.UnsafeCast`.
  """
  static = {}

  def arrays():
    leaves, static["treedef"] = jax.tree.flatten(local())
    static["leaves"] = leaves
    return [x for x in leaves if _is_array(x)]

  closed = jax.make_jaxpr(arrays)()
  reduced_fallbacks.check_casts(closed.jaxpr)
  values = iter(jax.extend.core.jaxpr_as_fun(closed)())
  return static["treedef"].unflatten([
      next(values) if _is_array(x) else x for x in static["leaves"]])


# What JAX raises when it refuses a reduced operand, or has no rule for one;
# reduced_fallbacks.UnsafeCast is a TypeError.
_REFUSALS = (compat.sharding_type_error(), TypeError, ValueError,
             NotImplementedError)


def build(
    local: Callable[[typed_layout.TypedLayout], stages.Partials],
    params: Any, param_specs: Any, grad_reduction: Any, policy: fsdp.Policy,
    axis_name: readers.AxisName, leaf_axes: list[int | None],
    num_microbatches: int = 1,
) -> tuple[typed_layout.TypedLayout, stages.Partials]:
  """The typed layout of ``params`` and ``local`` traced under it.

  ``local(layout)`` runs the call's *local* stage under a layout.
  """
  rules = grad_reduction_lib.per_leaf(grad_reduction, params)
  leaves, treedef = jax.tree.flatten(params)
  means = [rules is None or r == grad_reduction_lib.MEAN
           for r in (rules or [None] * len(leaves))]
  targets = _targets(params, param_specs, axis_name)
  candidates = [i for i, p in enumerate(leaves)
                if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                and means[i]]

  def layout(reduced: frozenset[int]) -> typed_layout.TypedLayout:
    return typed_layout.TypedLayout(
        axis_name, treedef, targets,
        [i in reduced for i in range(len(targets))], means, policy,
        leaf_axes)

  def attempt(reduced: frozenset[int]) -> stages.Partials:
    return local(layout(reduced))

  fallback, seconds = [], 0.0
  try:
    partials = _traced_once(lambda: attempt(frozenset(candidates)))
  except _REFUSALS:  # find says which leaves, or re-raises.
    started = time.perf_counter()
    fallback = reduced_fallbacks.find(attempt, candidates)
    seconds = time.perf_counter() - started
    partials = attempt(frozenset(c for c in candidates if c not in fallback))
  reduced_fallbacks.publish(reduced_fallbacks.report(
      params, fallback, readers.axes_of(axis_name), seconds,
      num_microbatches=num_microbatches,
      deferred=policy.gradient_sync == fsdp.DEFERRED))
  return layout(frozenset(c for c in candidates if c not in fallback)), (
      partials)
