"""The runner's TYPED form: under jax.jit, data axes of Explicit type.

``loss_fn`` runs as plain ``jax.jit(jax.value_and_grad(loss_fn))`` runs it,
on the global micro-batch (still sharded over the data axes): annotations
that name data axes, embeddings read with ``out_sharding=`` and the rest of
a model written for :func:`jax.jit` work in the loop. The stages:

1. *split*: the batch is laid out over the data axes (a replicated batch is
   sliced, without communication) and each device's shard cut into ``k``
   blocks (:mod:`batching`);
2. *hold*: each parameter typed ``reduced`` over the data axes, gathered
   first if sharded over them (:mod:`typed_layout`); leaves that JAX cannot
   type reduced stay replicated (:mod:`reduced_fallbacks`);
3. *local*: the entry point's loop, carrying unreduced gradient sums;
4. *reduce*: one :func:`jax.sharding.reshard` per gradient leaf to its
   parameter's sharding (:func:`typed_layout.finish`);
5. *finalize*: the means, as on one device. Loss, token counts, aux and
   model state are global values already: nothing else is reduced.
"""

import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import forms
from optax_accum._src import fsdp
from optax_accum._src import grad_reduction as grad_reduction_lib
from optax_accum._src import loss_signature
from optax_accum._src import noise_scale
from optax_accum._src import reduced_fallbacks
from optax_accum._src import sharding
from optax_accum._src import stages
from optax_accum._src import typed_layout


def _laid_out(x: Any, axis: int | None, axis_name: axes.AxisName) -> Any:
  """A batch leaf sharded over the data axes along ``axis`` (free)."""
  if axis is None:
    return x
  spec = sharding.full_spec(x)
  entries = list(sharding.partitions(spec))
  entries += [None] * (jnp.ndim(x) - len(entries))
  if entries[axis] is not None:
    return x  # forms.detect checked that these are the data axes.
  entries[axis] = axis_name
  return jax.sharding.reshard(x, P(*entries))


def _targets(params: Any, param_specs: Any,
             axis_name: axes.AxisName) -> list[P]:
  """Each parameter leaf's spec: its type's, over data axes ``param_specs``'."""
  leaves = jax.tree.leaves(params)
  if param_specs is None:
    data_specs = [None] * len(leaves)
  else:
    data_specs = jax.tree.leaves(
        fsdp.specs_like(params, param_specs, axis_name),
        is_leaf=lambda x: isinstance(x, P))
  return [
      typed_layout.merged_spec(sharding.full_spec(p), d, axis_name,
                               jnp.ndim(p))
      for p, d in zip(leaves, data_specs)
  ]


def _candidates(params: Any, rules: list[str] | None) -> list[int]:
  """The leaves to type reduced: floating, summed ("mean")."""
  return [
      i for i, p in enumerate(jax.tree.leaves(params))
      if jnp.issubdtype(jnp.result_type(p), jnp.inexact)
      and (rules is None or rules[i] == grad_reduction_lib.MEAN)
  ]


def run(program: stages.Program, settings: Any, params: Any,
        inputs: loss_signature.Inputs,
        axis_name: axes.AxisName) -> stages.Result:
  """Runs ``program`` with its data axes ``axis_name`` in the types."""
  leaf_axes = batching.leaf_axes(inputs.batch, settings.batch_axes)
  batching.check_divisible(
      batching.split_size(inputs.batch, leaf_axes), settings.num_microbatches,
      devices=forms.axis_size(axis_name))
  leaves, treedef = jax.tree.flatten(inputs.batch)
  inputs = inputs._replace(batch=treedef.unflatten([
      _laid_out(x, a, axis_name) for x, a in zip(leaves, leaf_axes)]))
  policy = fsdp.Policy() if program.coupled else settings.policy
  rules = grad_reduction_lib.per_leaf(settings.grad_reduction, params)
  targets = _targets(params, settings.param_specs, axis_name)
  candidates = _candidates(params, rules)

  def layout(reduced: frozenset[int]) -> typed_layout.Layout:
    return typed_layout.Layout(
        axis_name, jax.tree.structure(params), targets,
        [i in reduced for i in range(len(targets))], policy)

  def attempt(reduced: frozenset[int]) -> stages.Partials:
    lay = layout(reduced)
    return program.local(typed_layout.hold(lay, params), inputs, lay)

  fallback, seconds = [], 0.0
  try:
    reduced_fallbacks.check(attempt, frozenset(candidates))
    partials = attempt(frozenset(candidates))
  except Exception:  # find says which leaves, or re-raises.
    started = time.perf_counter()
    fallback = reduced_fallbacks.find(attempt, candidates)
    seconds = time.perf_counter() - started
    partials = attempt(frozenset(c for c in candidates if c not in fallback))
  reduced_fallbacks.publish(reduced_fallbacks.report(
      params, fallback, axes.axes_of(axis_name), seconds,
      # issue 32 item 7 (mesh helper): the cost per call, for the report.
      num_microbatches=settings.num_microbatches,
      deferred=settings.policy.gradient_sync == fsdp.DEFERRED))
  lay = layout(frozenset(c for c in candidates if c not in fallback))
  partials = partials._replace(
      grads=typed_layout.finish(lay, partials.grads))
  return program.finalize(partials, params, noise_scale.sq_norm)
