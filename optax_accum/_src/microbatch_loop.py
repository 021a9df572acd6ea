"""The scan over micro-batches: running sums of one device's micro-batches.

:func:`program` gives the runner (:mod:`runner`) this module's stages: *local*
runs :func:`loop` on one device's batch and hands its sums over as
:class:`stages.Partials`; *finalize* turns the reduced sums into the means
(:func:`finish`). The sums follow the
token-weighting rule of ``token_weighting``; aux is stacked or reduced in the
carry (``aux_reduction``); the noise-scale sums ride along with
``with_stats``.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import aux_reduction as aux_reduction_lib
from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import fsdp
from optax_accum._src import loss_signature
from optax_accum._src import microbatch_rng
from optax_accum._src import noise_scale
from optax_accum._src import stages
from optax_accum._src import token_weighting
from optax_accum._src import validation


class Sums(NamedTuple):
  """The loop's running sums (per device under ``axis_name``)."""

  grads: Any  # like params, dtype=accumulator_dtype.
  loss: jax.Array  # shape=(), dtype=accumulator_dtype.
  tokens: jax.Array  # shape=(), dtype=jnp.float32.
  aux: aux_reduction_lib.Running | None  # None when aux is only stacked.
  stats: noise_scale.StatsSums | None  # None without with_stats.


class AuxPlan(NamedTuple):
  """How each aux leaf is reduced, and its shape (one micro-batch's)."""

  reductions: list[str]
  shapes: list[jax.ShapeDtypeStruct]
  treedef: Any


class LoopOut(NamedTuple):
  """What the loop gives besides its sums."""

  model_state: Any
  loss_dtype: Any  # the dtype loss_fn returns.
  stacked: Any  # aux (or its stacked leaves), one entry per micro-batch.
  plan: AuxPlan | None  # None when aux is only stacked.


class Options(NamedTuple):
  """The validated settings of one :func:`value_and_grad`."""

  num_microbatches: int
  has_aux: bool
  has_state: bool
  num_tokens_fn: Callable[[Any], Any]  # token_weighting.count_fn's.
  loss_reduction: str
  axis_name: axes.AxisName | None  # as given; the runner finds the form.
  accumulator_dtype: Any
  batch_axes: Any
  aux_reduction: Any
  with_stats: bool
  param_specs: Any  # None, a PartitionSpec or a tree of them.
  fsdp_policy: fsdp.Policy


def _token_count(num_tokens_fn, microbatch):
  return validation.as_token_count(
      "num_tokens_fn(microbatch)", num_tokens_fn(microbatch)
  )


def _axis_of(lay: fsdp.Layout | None) -> axes.AxisName | None:
  """The data axes this device's loop runs over (None on one device)."""
  return None if lay is None else lay.axis_name


def _rng_for(inputs, index, lay):
  if inputs.rng is None:
    return None
  return microbatch_rng.key_for(inputs.rng, index, _axis_of(lay))


def _aux_plan(loss, opts, params_for, inputs, batch_split,
              lay) -> AuxPlan | None:
  """Micro-batch 0's aux shapes (traced, not run), when aux is reduced."""
  if not aux_reduction_lib.is_running(opts.aux_reduction):
    return None
  microbatch = batching.take(batch_split, 0)
  _, (_, aux) = jax.eval_shape(lambda: loss(
      params_for(jnp.zeros([], jnp.int32)), inputs.model_state, microbatch,
      inputs, _rng_for(inputs, 0, lay)
  ))
  shapes, treedef = jax.tree.flatten(aux)
  reductions = aux_reduction_lib.per_leaf(opts.aux_reduction, aux)
  return AuxPlan(reductions, shapes, treedef)


def _zero_sums(params, opts: Options, plan: AuxPlan | None,
               lay: fsdp.Layout | None) -> Sums:
  sums = Sums(
      # zeros_like keeps each parameter's sharding (model-parallel axes).
      grads=jax.tree.map(
          lambda p: jnp.zeros_like(p, dtype=opts.accumulator_dtype), params
      ) if lay is None else fsdp.zero_grads(
          lay, params, opts.accumulator_dtype),
      loss=jnp.zeros([], opts.accumulator_dtype),
      tokens=jnp.zeros([], jnp.float32),
      aux=None if plan is None else aux_reduction_lib.init(
          plan.shapes, plan.reductions, opts.accumulator_dtype),
      stats=noise_scale.zero_sums() if opts.with_stats else None,
  )
  if lay is not None:
    # The sums are this device's partial sums: they differ by device.
    sums = axes.device_local(sums, lay.axis_name)
  return sums


def loop(loss, opts: Options, params, inputs: loss_signature.Inputs,
         lay: fsdp.Layout | None = None):
  """The scan over this device's micro-batches: ``(sums, loop_out)``.

  With an FSDP layout ``lay``, ``params`` are what :func:`fsdp.hold` keeps:
  gathered for each micro-batch, and the gradients summed, as it says.
  """

  def params_for(index):
    return params if lay is None else fsdp.for_microbatch(lay, params, index)

  batch_split = batching.split(
      inputs.batch, opts.batch_axes, opts.num_microbatches,
      sharded_layout_for_auto=lay is None,
  )
  plan = _aux_plan(loss, opts, params_for, inputs, batch_split, lay)
  value_and_grad_fn = jax.value_and_grad(loss, has_aux=True)

  def step(carry, index):
    sums, model_state = carry
    microbatch = batching.take(batch_split, index)
    (value, (model_state, aux)), grads = value_and_grad_fn(
        params_for(index), model_state, microbatch, inputs,
        _rng_for(inputs, index, lay)
    )
    tokens = _token_count(opts.num_tokens_fn, microbatch)
    c = token_weighting.contribution(tokens, opts.loss_reduction)
    running, stacked = sums.aux, aux
    if plan is not None:
      running, stacked = aux_reduction_lib.update(
          running, jax.tree.leaves(aux), plan.reductions, tokens)
    sums = Sums(
        grads=token_weighting.add(sums.grads, grads, c) if lay is None
        else fsdp.add_grads(lay, sums.grads, grads, c),
        loss=sums.loss + token_weighting.weighted(value, c, sums.loss.dtype),
        tokens=sums.tokens + c.tokens,
        aux=running,
        stats=None if sums.stats is None else noise_scale.add(
            sums.stats, grads, c, opts.loss_reduction),
    )
    # The per-micro-batch losses only tell their dtype: XLA drops them.
    return (sums, model_state), (value, stacked)

  with jax.named_scope("optax_accum_microbatch_loop"):
    (sums, model_state), (values, stacked) = lax.scan(
        step, (_zero_sums(params, opts, plan, lay), inputs.model_state),
        jnp.arange(opts.num_microbatches),
    )
  return sums, LoopOut(model_state, values.dtype, stacked, plan)


def finish(sums: Sums, out: LoopOut, params,
           sq_norm: Callable[[Any], jax.Array] = noise_scale.sq_norm,
           ) -> stages.Result:
  """The loss, gradient, aux and stats from the (device-reduced) sums.

  ``sq_norm`` is the squared norm of a gradient tree: the sum over devices of
  its shards' when the gradient comes back sharded (FSDP).
  """
  grads = token_weighting.mean(sums.grads, sums.tokens, params)
  stats = None
  if sums.stats is not None:
    # The norm of the mean in the accumulator's precision, not the params'.
    exact = token_weighting.mean(sums.grads, sums.tokens, sums.grads)
    stats = noise_scale.estimate_from_norm(
        sums.stats, sq_norm(exact), sums.tokens)
  loss = token_weighting.mean(
      sums.loss, sums.tokens, jnp.zeros([], out.loss_dtype))
  if out.plan is None:
    aux = aux_reduction_lib.Parts(out.stacked, None)
  else:
    aux = aux_reduction_lib.finish(
        sums.aux, out.stacked, out.plan.reductions, out.plan.shapes,
        sums.tokens, out.plan.treedef)
  return stages.Result(loss, grads, out.model_state, aux, stats)


def _partials(sums: Sums, out: LoopOut) -> stages.Partials:
  """The loop's sums, by how each is reduced over devices."""
  running = sums.aux
  maxima, minima = [], []
  if running is not None:
    maxima, minima = aux_reduction_lib.split_extrema(
        running, out.plan.reductions)
  return stages.Partials(
      grads=sums.grads,
      sums=(sums.loss, sums.tokens,
            None if running is None else running.sums, sums.stats),
      maxima=maxima, minima=minima, means=out.model_state, rest=out)


def _finalize(partials: stages.Partials, params,
              sq_norm: Callable[[Any], jax.Array]) -> stages.Result:
  """:func:`finish` on the (reduced) :class:`stages.Partials`."""
  loss, tokens, aux_sums, stats = partials.sums
  out = partials.rest._replace(model_state=partials.means)
  running = None
  if out.plan is not None:
    running = aux_reduction_lib.join_extrema(
        aux_sums, out.plan.reductions, partials.maxima, partials.minima)
  sums = Sums(partials.grads, loss, tokens, running, stats)
  return finish(sums, out, params, sq_norm)


def program(loss, opts: Options) -> stages.Program:
  """The runner's :class:`stages.Program` of one ``value_and_grad``."""

  def local(params, inputs, lay):
    return _partials(*loop(loss, opts, params, inputs, lay))

  return stages.Program(local=local, finalize=_finalize, aux_axis=1,
                        new_aux_axis=False, coupled=False)
