"""The typed layout of a call, built from one trace: which leaves are reduced.

:func:`build_typed` traces the call's *local* stage with every candidate
leaf typed reduced, once, into a jaxpr whose casts
:func:`cast_checks.check_casts` checks, then evaluates it in place
(re-binding its equations, without running ``loss_fn``'s Python again), so
that a model without fallback leaves costs one trace of ``loss_fn``. If
that trace fails, :func:`reduced_fallbacks.find` finds the leaves that JAX
cannot type reduced, which stay replicated. Where the platform and the
policy allow it (:func:`hands_shards_on`), the leaves sharded over every
data axis go to ``loss_fn`` as their shards
(:class:`typed_layout.TypedLayout`'s ``shards_to_loss``).
"""

from collections.abc import Callable
import time
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import names
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import cast_checks
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import reduced_fallbacks
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
      readers.merged_spec(readers.full_spec(p), d, axis_name, jnp.ndim(p))
      for p, d in zip(leaves, data_specs)
  ]


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.core.Tracer))


def _traced_once(local: Callable[[], layout.Partials]) -> layout.Partials:
  """``local()``, traced into a jaxpr, its casts checked, then evaluated.

  Raises as the trace does, or :class:`cast_checks.UnsafeCast`.
  """
  static = {}

  def arrays():
    leaves, static["treedef"] = jax.tree.flatten(local())
    static["leaves"] = leaves
    return [x for x in leaves if _is_array(x)]

  closed = jax.make_jaxpr(arrays)()
  cast_checks.check_casts(closed.jaxpr)
  values = iter(jax.extend.core.jaxpr_as_fun(closed)())
  return static["treedef"].unflatten([
      next(values) if _is_array(x) else x for x in static["leaves"]])


# What JAX raises when it refuses a reduced operand, or has no rule for one;
# cast_checks.UnsafeCast is a TypeError.
_REFUSALS = (compat.sharding_type_error(), TypeError, ValueError,
             NotImplementedError)


def hands_shards_on(platform: str | None) -> bool:
  """Whether the loop differentiates shards on ``platform``: on TPU and
  GPU; not on the CPU, where XLA writes the backward pass's reduce-scatter
  of a shard's gradient as a whole all-reduce (twice the bytes on the wire;
  the tests force it there to check its arithmetic), nor where it is not
  known."""
  return platform in ("tpu", "gpu", "cuda", "rocm")


def build_typed(
    local: Callable[[typed_layout.TypedLayout], layout.Partials],
    params: Any, param_specs: Any, grad_reduction: Any, policy: fsdp.Policy,
    axis_name: readers.AxisName, leaf_axes: list[int | None],
    num_microbatches: int = 1, shards_ok: list[bool] | None = None,
) -> tuple[typed_layout.TypedLayout, layout.Partials]:
  """The typed layout of ``params`` and ``local`` traced under it.

  ``local(layout)`` runs the call's *local* stage under a layout;
  ``shards_ok`` says which leaves it may differentiate as shards (the
  layout's ``shards_to_loss``, where the policy and the model allow it).
  """
  rules = grad_reduction_lib.rules_per_leaf(grad_reduction, params)
  leaves, treedef = jax.tree.flatten(params)
  means = [rules is None or r == grad_reduction_lib.MEAN
           for r in (rules or [None] * len(leaves))]
  targets = _targets(params, param_specs, axis_name)
  candidates = [i for i, p in enumerate(leaves)
                if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
                and means[i]]

  if not shards_ok or not hands_shards_on(readers.mesh_platform(params)):
    shards_ok = [False] * len(leaves)

  def layout_for(reduced: frozenset[int],
                 shards=False) -> typed_layout.TypedLayout:
    lay = typed_layout.TypedLayout(
        axis_name, treedef, targets,
        [i in reduced for i in range(len(targets))], means, policy,
        leaf_axes)
    return lay._replace(shards_to_loss=frozenset(
        i for i, ok in enumerate(shards_ok)
        if shards and ok and lay.can_hand_shard(i)))

  def attempt(reduced: frozenset[int], shards=False) -> layout.Partials:
    return local(layout_for(reduced, shards))

  fallback, seconds = [], 0.0
  shards = bool(layout_for(frozenset(candidates), True).shards_to_loss)
  try:
    partials = _traced_once(lambda: attempt(frozenset(candidates), shards))
  except _REFUSALS:  # find says which leaves, or re-raises.
    started = time.perf_counter()
    fallback = reduced_fallbacks.find(attempt, candidates)
    seconds = time.perf_counter() - started
    kept = frozenset(c for c in candidates if c not in fallback)
    # Shards only if the loss takes them (the first trace's failure may be
    # theirs rather than the fallback leaves').
    shards = shards and reduced_fallbacks.traces(
        lambda r: attempt(r, True), kept)
    partials = attempt(kept, shards)
  whole = [] if param_specs is None else [
      i for i, t in enumerate(targets)
      if not readers.data_axes_in(t, axis_name)]
  reduced_fallbacks.publish(reduced_fallbacks.report(
      params, fallback, readers.axes_of(axis_name), seconds,
      num_microbatches=num_microbatches,
      deferred=policy.gradient_sync == names.DEFERRED, whole=whole))
  return layout_for(frozenset(c for c in candidates if c not in fallback),
                    shards), partials
