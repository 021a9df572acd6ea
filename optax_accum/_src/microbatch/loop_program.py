"""The micro-batch loop's stages for the runner: its sums made results.

:func:`program` gives the runner (:mod:`runner`) the loop's stages: *local*
runs :func:`loop.loop` on the loop's batch (one device's, or the global one)
and hands its sums over as :class:`layout.Partials`; *finalize* turns the
reduced sums into the means (:func:`finish_loop`), or casts the means
already divided before the reduction (:func:`divides_first`).
"""

import jax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import loop as loop_lib
from optax_accum._src.microbatch import trip_count
from optax_accum._src.rules import aux_reduction as aux_reduction_lib
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


def finish_loop(sums: loop_lib.Sums, out: loop_lib.LoopOut, params,
                lay: layout.Layout, divided: bool = False) -> layout.Result:
  """The loss, gradient, aux and stats from the (device-reduced) sums.

  ``lay.sq_norms`` gives the squared norm of each stats group of a reduced
  gradient (summed over its shards, if sharded). ``divided``: the "mean"
  leaves of ``sums.grads`` are means already (:func:`divides_first`).
  """
  # Zeros without tokens whatever the sums hold: the borrowing loop runs its
  # micro-batches though none has tokens (trip_count.run_borrowing).
  grads = grad_reduction_lib.mean_by_rule(sums.grads, sums.tokens, params,
                                          out.grad_rules, divided,
                                          zeros_if_empty=True)
  stats = None
  if sums.stats is not None:
    # The norm of the mean in the accumulator's precision, not the params'.
    exact = grad_reduction_lib.only_means(sums.grads if divided else (
        token_weighting.mean(sums.grads, sums.tokens, sums.grads)),
        out.grad_rules)
    stats = noise_scale.estimate_from_groups(
        sums.stats, lay.sq_norms(exact), sums.tokens)
  loss = token_weighting.mean(
      sums.loss, sums.tokens, jnp.zeros([], out.loss_dtype),
      zeros_if_empty=True)
  if out.plan is None:
    aux = aux_reduction_lib.Parts(out.stacked, None)
  else:
    aux = aux_reduction_lib.finish_aux(
        sums.aux, out.stacked, out.plan.reductions, out.plan.shapes,
        sums.tokens, out.plan.treedef)
  return layout.Result(loss, grads, out.model_state, aux, stats)


def _partials(sums: loop_lib.Sums, out: loop_lib.LoopOut) -> layout.Partials:
  """The loop's sums, by how each is reduced over devices."""
  running = sums.aux
  maxima, minima = [], []
  if running is not None:
    maxima, minima = aux_reduction_lib.split_extrema(
        running, out.plan.reductions)
  return layout.Partials(
      grads=sums.grads,
      sums=(sums.loss, sums.tokens,
            None if running is None else running.sums, sums.stats),
      maxima=maxima, minima=minima, means=out.model_state, rest=out,
      in_loop=out.in_loop)


def divides_first(opts: loop_lib.Options, lay: layout.Layout) -> bool:
  """Whether each device's partial sum of a "mean" leaf is divided by the
  token count before the one reduction over devices, not after it.

  Where the loop sees the global batch (``lay.device_axis`` is None), its
  token count is the global one before the reduction: the division may come
  first, and XLA then reduces each leaf's mean in place. Divided after the
  reduction, XLA's GPU compiler held reduced sums beside their means, above
  the peak of a hand-written scan on a data-only mesh
  (benchmarks/results/divide_first.md). Not where the last micro-batch runs
  after the loop (:func:`trip_count.peeled`): there it raised the peak.
  """
  return lay.device_axis is None and not trip_count.peeled(
      opts.overlap_reduction, opts.num_microbatches,
      lay.reduces_only_after_loop())


def _divided(sums: loop_lib.Sums, out: loop_lib.LoopOut) -> loop_lib.Sums:
  """The sums with each "mean" leaf divided by the token count, in the
  accumulator's dtype (:func:`divides_first`)."""
  return sums._replace(grads=grad_reduction_lib.divide_means(
      sums.grads, sums.tokens, out.grad_rules))


def _finalize(partials: layout.Partials, params,
              lay: layout.Layout, divided: bool = False) -> layout.Result:
  """:func:`finish_loop` on the (reduced) :class:`layout.Partials`."""
  loss, tokens, aux_sums, stats = partials.sums
  out = partials.rest._replace(model_state=partials.means)
  running = None
  if out.plan is not None:
    running = aux_reduction_lib.join_extrema(
        aux_sums, out.plan.reductions, partials.maxima, partials.minima)
  sums = loop_lib.Sums(partials.grads, loss, tokens, running, stats)
  return finish_loop(sums, out, params, lay, divided)


def _shards_ok(opts: loop_lib.Options, params) -> list[bool]:
  """Leaves whose shard the loop may differentiate: not with ``with_stats``
  (it reads each device's partial gradient), and only where the sum's dtype
  is the leaf's (JAX reduce-scatters a shard's gradient in its dtype)."""
  if opts.with_stats:
    return [False] * len(jax.tree.leaves(params))
  dtypes = validation.per_leaf_dtypes(opts.accumulator_dtype, params)
  return [jnp.dtype(d) == jnp.result_type(p) for p, d in
          zip(jax.tree.leaves(params), jax.tree.leaves(dtypes))]


def program(loss, opts: loop_lib.Options) -> layout.Program:
  """The runner's :class:`layout.Program` of one ``value_and_grad``."""

  def local(params, inputs, lay):
    sums, out = loop_lib.loop(loss, opts, params, inputs, lay)
    if divides_first(opts, lay):
      sums = _divided(sums, out)
    return _partials(sums, out)

  def finalize(partials, params, lay):
    return _finalize(partials, params, lay, divides_first(opts, lay))

  return layout.Program(local=local, finalize=finalize, aux_axis=1,
                        new_aux_axis=False,
                        shards_ok=lambda params: _shards_ok(opts, params))
