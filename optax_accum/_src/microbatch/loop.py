"""The scan over micro-batches: running sums of the loop's micro-batches.

:func:`loop` runs on the loop's batch (one device's, or the global one);
:mod:`loop_program` makes it the runner's stages and its sums results. The sums
follow the token-weighting rule of ``token_weighting``; aux is stacked or
reduced in the carry (``aux_reduction``); the noise-scale sums ride along
with ``with_stats``. Where parameters are held and gradients summed is the
call's :class:`layout.Layout`'s business: the loop only calls it. Where
:mod:`borrowing` applies, each gradient leaves the backward pass weighted.
How many trips the loop runs (all k, the first ``num_real_microbatches``,
or borrowing's), and whether the last runs after it so that the one
reduction can overlap its backward pass, is :mod:`trip_count`'s business;
a model's scanned layers reduced in that last one, :mod:`scanned_layers`'.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._src import names
from optax_accum._src import validation
from optax_accum._src.mesh import axes
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import borrowing
from optax_accum._src.microbatch import empty_safe
from optax_accum._src.microbatch import layer_sums
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import loss_signature
from optax_accum._src.microbatch import rng as rng_lib
from optax_accum._src.microbatch import trip_count
from optax_accum._src.rules import aux_reduction as aux_reduction_lib
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


class Sums(NamedTuple):
  """The loop's running sums (per device under ``axis_name``)."""

  grads: Any  # like params, dtype=accumulator_dtype (per leaf).
  loss: jax.Array  # shape=(), validation.scalar_sum_dtype.
  tokens: jax.Array  # shape=(), dtype=jnp.float32.
  aux: aux_reduction_lib.Running | None  # None when aux is only stacked.
  stats: list[noise_scale.StatsSums] | None  # per group; None without.


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
  grad_rules: list[str] | None = None  # grad_reduction per leaf.
  # Per gradient leaf, its sum already reduced over devices in the last
  # micro-batch's layer scan (:mod:`scanned_layers`), or None; None: none.
  in_loop: list[Any] | None = None


class Options(NamedTuple):
  """What the loop reads of one :func:`value_and_grad`'s settings."""

  num_microbatches: int
  num_tokens_fn: Callable[[Any], Any]  # token_weighting.count_fn's.
  loss_reduction: str
  accumulator_dtype: Any  # a dtype, or a tree prefix of params of them.
  aux_reduction: Any
  with_stats: bool
  grad_reduction: Any = None  # None: every leaf "mean".
  has_aux: bool = True  # whether loss_fn returns aux (True: may).
  has_state: bool = True  # whether loss_fn threads a model state.
  overlap_reduction: bool = False  # the last micro-batch after the loop.


def _token_count(num_tokens_fn, microbatch):
  return validation.as_token_count(
      "num_tokens_fn(microbatch)", num_tokens_fn(microbatch)
  )


def _rng_for(inputs, index, lay: layout.Layout):
  if inputs.rng is None:
    return None
  return rng_lib.key_for(inputs.rng, index, lay.device_axis)


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
  reductions = aux_reduction_lib.aux_rules_per_leaf(opts.aux_reduction, aux)
  return AuxPlan(reductions, shapes, treedef)


def _borrowing(opts, params, inputs, batch_split, plan, rules, lay):
  """:mod:`borrowing`'s plan, where it applies; else None.

  Only where the loop sees the global batch: each device's own count could
  leave one device with no micro-batch to borrow, whose zeros would then be
  0/0 (and reach the others' sums through a reduction in the loop). And only
  for k > 1: one micro-batch has none to borrow, and XLA drops its scan of
  one trip (not so a loop whose trips are counted at run time, which then
  holds more memory on TPU).
  """
  if (opts.num_microbatches == 1 or lay.device_axis is not None
      or not borrowing.applies(
      has_state=opts.has_state, has_aux=opts.has_aux,
      aux_reductions=None if plan is None else plan.reductions,
      with_stats=opts.with_stats, rules=rules, params=params)):
    return None
  if not token_weighting.counts_each(opts.num_tokens_fn):
    return borrowing.UNCOUNTED
  return borrowing.plan(
      lambda mb: _token_count(opts.num_tokens_fn, mb),
      lambda i: batching.take(batch_split, i), opts.num_microbatches,
      inputs.num_real, opts.loss_reduction)


class _Differentiated(NamedTuple):
  """One micro-batch differentiated (:func:`_differentiate`)."""

  value: jax.Array
  rest: Any  # (new model state, aux).
  grads: Any
  c: token_weighting.Contribution  # its own: the loss's and tokens'.
  added: token_weighting.Contribution  # the one the gradient is added with.
  microbatch: Any  # the data that ran.
  totals: dict[int, jax.Array] | None = None  # scanned_layers' reduced sums.


def _differentiate(loss, opts, borrow, inputs, lay, params, model_state,
                   batch_split, index, runs=None) -> _Differentiated:
  """Micro-batch ``index`` differentiated; with ``borrow``, as
  :mod:`borrowing` says; with ``runs`` (leaf index -> running sum), its
  scanned layers reduced as :mod:`scanned_layers` says."""
  rng = _rng_for(inputs, index, lay)
  source = index if borrow is None else borrow.source_of(index)
  microbatch = batching.take(batch_split, source)
  args = (model_state, microbatch, inputs, rng)

  def contribution():
    tokens = (borrow.counts[index] if borrow is not None
              and borrow.counts is not None
              else _token_count(opts.num_tokens_fn, microbatch))
    return token_weighting.contribution(tokens, opts.loss_reduction)

  if runs:
    c = contribution()
    d = layer_sums.differentiate(loss, args, params, runs, c,
                                 lay.sum_in_loop, own_data=borrow is None)
    return _Differentiated(d.value, d.rest, d.grads, c, d.added, microbatch,
                           d.totals)
  if borrow is None:
    if token_weighting.counts_each(opts.num_tokens_fn):
      c = contribution()  # an empty micro-batch is dropped, derivative too.
      (value, rest), grads = empty_safe.value_and_grad(loss, c.keep, params,
                                                       *args)
    else:  # each counts one: none is dropped. The loss is checked first,
      # before the first count warns that there are none.
      (value, rest), grads = jax.value_and_grad(loss, has_aux=True)(
          params, *args)
      c = contribution()
    return _Differentiated(value, rest, grads, c, c, microbatch)
  value, vjp_fn, rest = jax.vjp(lambda p: loss(p, *args), params,
                                has_aux=True)
  c = contribution()
  grads, added = borrowing.weighted_grads(vjp_fn, value, c)
  return _Differentiated(value, rest, grads, c, added, microbatch)


def _zero_sums(params, opts: Options, plan: AuxPlan | None,
               lay: layout.Layout, rules) -> Sums:
  dtypes = validation.per_leaf_dtypes(opts.accumulator_dtype, params)
  scalar_dtype = validation.scalar_sum_dtype(opts.accumulator_dtype, params)
  sums = Sums(
      grads=grad_reduction_lib.start(lay.zero_grads(params, dtypes), rules),
      loss=jnp.zeros([], scalar_dtype),
      tokens=jnp.zeros([], jnp.float32),
      aux=None if plan is None else aux_reduction_lib.init(
          plan.shapes, plan.reductions, scalar_dtype),
      stats=lay.zero_stats() if opts.with_stats else None,
  )
  # Under manual axes the sums are this device's: they differ by device.
  return lay.device_local(sums)


def loop(loss, opts: Options, params, inputs: loss_signature.Inputs,
         lay: layout.Layout):
  """The scan over the loop's micro-batches: ``(sums, loop_out)``.

  ``params`` are what ``lay.hold`` keeps: made whole for each micro-batch,
  and the gradients summed, as ``lay`` says.
  """

  def params_for(index):
    return lay.for_microbatch(params, index)

  batch_split = lay.split(inputs.batch, opts.num_microbatches)
  plan = _aux_plan(loss, opts, params_for, inputs, batch_split, lay)
  rules = grad_reduction_lib.rules_per_leaf(opts.grad_reduction, params)
  # The sums first: a misfit accumulator_dtype is named before any count.
  init = (_zero_sums(params, opts, plan, lay, rules), inputs.model_state)
  borrow = _borrowing(opts, params, inputs, batch_split, plan, rules, lay)

  peeled = trip_count.peeled(opts.overlap_reduction, opts.num_microbatches,
                             lay.reduces_only_after_loop())
  layers = layer_sums.LoopLayers(loss, layer_sums.reducible_leaves(
      opts.with_stats, lay, rules, len(jax.tree.leaves(params)))
      if peeled else [])

  def step_over(params, batch_split, reducible=()):
    def step(carry, index):
      sums, model_state = carry
      running = jax.tree.leaves(sums.grads)
      d = _differentiate(layers.loss_for(reducible), opts, borrow, inputs, lay,
                         lay.for_microbatch(params, index),
                         model_state, batch_split, index,
                         {i: running[i] for i in reducible})
      value, (new_state, aux), grads, c = d.value, d.rest, d.grads, d.c
      model_state = axes.varying_like(new_state, model_state)
      running, stacked = sums.aux, aux
      if plan is not None:
        running, stacked = aux_reduction_lib.update(
            running, jax.tree.leaves(aux), plan.reductions, c.tokens)
      sums = Sums(
          grads=layers.added(lay.add_grads(sums.grads, grads, d.added, rules),
                             grads, d.totals, d.added.keep, lay),
          loss=sums.loss + token_weighting.weighted(value, c, sums.loss.dtype),
          tokens=sums.tokens + c.tokens,
          aux=running,
          stats=None if sums.stats is None else lay.add_stats(
              sums.stats, grad_reduction_lib.only_means(grads, rules), c,
              opts.loss_reduction, opts.num_tokens_fn, d.microbatch),
      )
      # The per-micro-batch losses only tell their dtype: XLA drops them.
      return (sums, model_state), (value, stacked)

    return step

  def last_step(carry):
    """The step of the last trip, after the loop (:func:`trip_count.peeled`):
    its parameters and batch pass a barrier with the loop's result, else
    XLA may run that micro-batch before or beside the loop, its gradient
    held through it (more memory, measured on the CPU)."""
    _, held, leaves = jax.lax.optimization_barrier(
        (carry[0].tokens, params, batch_split.leaves))
    return step_over(held, batch_split._replace(leaves=leaves),
                     layers.for_last())

  step, last = step_over(params, batch_split), last_step if peeled else None
  with jax.named_scope(names.LOOP_SCOPE):
    if borrow is None:
      (sums, model_state), (values, stacked) = trip_count.run_microbatches(
          step, init, opts.num_microbatches, inputs.num_real, last)
    else:
      (sums, model_state), (values, stacked) = trip_count.run_borrowing(
          step, init, borrow.runs, opts.num_microbatches,
          inputs.num_real, last)
  sums = sums._replace(grads=lay.after_loop(sums.grads, rules))
  return sums, LoopOut(model_state, values.dtype, stacked, plan, rules,
                       layers.per_leaf(len(jax.tree.leaves(params))))
