"""The emitting step of :func:`optax_accum.accumulate`: one emit decision.

On the call that ends a cycle, the running sums (reduced over the devices by
the call's :class:`sum_layout.SumLayout`: the one reduction per update)
become the token-weighted mean that ``inner`` is run on; a cycle without
tokens makes no update and leaves ``inner``'s state alone. Every other call
skips. Both choices, ``emit`` (the cycle ends) and, inside its branch after
the reduction, ``updated`` (the cycle had tokens), are made by
:func:`choose`: a ``lax.cond``, or where the output rides in a loop's carry,
on GPUs a loop of at most one trip (XLA's GPU compiler copies what a
conditional passes through; a loop's carry it updates in place).

What the step hands back is its ``outputs.Output``, picked once by
:func:`output_for`: the updates, the sum's buffer holding them, or the
parameters with them applied (:mod:`outputs`).

``inner.update`` is traced once per call: each branch is a nested
:func:`jax.jit`, traced once, whose trace the variants that
``lax.platform_dependent`` traces (a conditional, a loop) take from jit's
cache; XLA inlines the calls.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import conditional_loops
from optax_accum._src import names
from optax_accum._src.accumulate import outputs
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


def choose(pred: jax.Array, made: Callable[[Any, Any], Any],
           skip: Callable[[Any, Any], Any], init: Any, reads: Any,
           how: str) -> Any:
  """``made(init, reads)`` where ``pred``, else ``skip(init, like)``.

  ``made`` is traced once (a nested :func:`jax.jit`, whose trace every
  variant reuses from jit's cache; XLA inlines the call); ``like`` is its
  output's types.
  ``how`` says how: :data:`outputs.COND`, or, where ``skip`` hands back ``init``
  (typed like ``made``'s output) and ``init`` rides in a loop's carry,
  :data:`outputs.LOOP_ON_GPU` or :data:`outputs.LOOP`.
  """
  made = jax.jit(made)  # traced once: every later call hits jit's cache.
  like = jax.eval_shape(made, init, reads)
  branched = lambda: lax.cond(pred, made, lambda i, r: skip(i, like), init,
                              reads)
  looped = lambda: conditional_loops.run_if(pred, made, init, reads)
  if how == outputs.COND:
    return branched()
  if how == outputs.LOOP:
    return looped()
  return conditional_loops.per_compiler(branched, looped)


class Emitter(NamedTuple):
  """Runs ``inner`` on a cycle's mean (made by :func:`emitter`)."""

  inner: optax.GradientTransformationExtraArgs
  params: Any  # as given to update (None allowed).
  extra_args: dict[str, Any]  # as given: see window_args.for_inner.
  like_grads: Any  # the gradients' tree: the mean takes their dtypes.
  rules: list[str] | None  # grad_reduction per leaf; None: all "mean".
  # _run as a nested jax.jit: traced once, its trace reused from jit's
  # cache wherever it is called again on the same types.
  run: Callable[..., Any]


def emitter(inner, params, extra_args, like_grads, rules) -> Emitter:
  """The :class:`Emitter` of one ``update`` call."""
  def run(grad_sum, token_count, value_sums, inner_state, params):
    """``inner``'s updates, laid out like the parameters, and its state."""
    mean = grad_reduction_lib.mean_by_rule(grad_sum, token_count, like_grads,
                                           rules)
    updates, new_state = inner.update(
        mean, inner_state, params,
        **window_args.for_inner(extra_args, value_sums, mean))
    updates = _laid_out_like(updates, params, like_grads)
    _check_same_layout(new_state, inner_state)
    return updates, optax.tree.cast_like(new_state, inner_state)

  return Emitter(inner, params, extra_args, like_grads, rules, jax.jit(run))


def _layout(x: Any) -> tuple[Any, ...]:
  return jnp.shape(x), readers.plain_spec(x), readers.unreduced_axes(x)


def _check_same_layout(new_state: Any, inner_state: Any) -> None:
  """``inner``'s new state must be laid out as the state it was given (the
  skipping branch hands that one back): else a state from another layout."""
  for (path, new), old in zip(
      jax.tree_util.tree_leaves_with_path(new_state),
      jax.tree.leaves(inner_state)):
    if _layout(new) != _layout(old):
      raise ValueError(
          f"state.inner_state{jax.tree_util.keystr(path)} is typed"
          f" {jax.typeof(old)}, but this transformation's update makes it"
          f" {jax.typeof(new)}: the state comes from another layout (a"
          " checkpoint saved before shard_optimizer= or the parameters'"
          " sharding changed, or tx.init called outside the jax.set_mesh"
          " of the update). Make the state with this transformation's"
          " tx.init(params) under the same mesh, or restore the checkpoint"
          " into that layout (jax.eval_shape(tx.init, params) as its"
          " target).")


def _laid_out_like(updates: Any, params: Any, grads: Any) -> Any:
  """Each update laid out as its parameter is (as its gradient without
  parameters).

  An inner state sharded over the data axes (ZeRO, or an ``nnx.Optimizer``
  whose Variables carry Flax's ``optimizer_sharding``) makes sharded
  updates of replicated parameters: gathered here, in the emitting branch,
  once per update (ZeRO-1's all-gather).
  """
  def like(u, target):
    if (target is None or readers.sharded_by_explicit_axes(u) is None
        or (params is not None and readers.unreduced_axes(target))):
      return u
    spec = readers.plain_spec(target)
    return u if readers.plain_spec(u) == spec else jax.sharding.reshard(
        u, spec)

  if params is None:
    return jax.tree.map(like, updates, grads)
  return jax.tree.map(like, updates, params,
                      is_leaf=lambda x: x is None)


def output_for(apply: bool, layout: sum_layout.SumLayout, emitter: Emitter,
               cycle: sum_layout.Cycle, inner_state: Any) -> outputs.Output:
  """The output of one call, picked once.

  ``oa.update_and_apply``'s is :class:`Applied`; ``tx.update``'s is
  :class:`Updates`, or :class:`UpdatesInSum` where the emitting branch reads
  the sums as they are (the single form) and the sum's buffer holds the
  updates exactly. The updates' types are read off ``emitter.run``'s trace
  on the sums, the one trace of ``inner`` that the branches reuse.
  """
  if apply:
    if any(readers.unreduced_axes(s) for s in jax.tree.leaves(cycle.grad_sum)):
      # A sum typed unreduced that a loop reads is all-reduced before the
      # loop, on every call (XLA, on every compiler: the whole gradient per
      # micro-step, 8 MiB of 8 MiB on 8 H100s); a conditional reads it as
      # it is.
      return outputs.Applied(emit_choice=outputs.COND)
    return outputs.Applied()
  if not layout.local:
    return outputs.Updates()
  like_updates = jax.eval_shape(
      emitter.run, cycle.grad_sum, cycle.token_count, cycle.value_sums,
      inner_state, emitter.params)[0]
  if outputs.fits(like_updates, cycle.grad_sum):
    return outputs.UpdatesInSum(like_updates)
  return outputs.Updates()


def decide(emit: jax.Array, cycle: sum_layout.Cycle, state: Any,
           layout: sum_layout.SumLayout, emitter: Emitter,
           output: outputs.Output) -> outputs.Emitted:
  """The emitting branch where ``emit``, else the skipping one."""

  def emitting(carry: outputs.Emitted,
               reads: sum_layout.Cycle) -> outputs.Emitted:
    with jax.named_scope(names.EMIT_SCOPE):
      grad_sum, params = output.joined(carry.out, reads)
      reduced = layout.reduced(reads._replace(grad_sum=grad_sum),
                               emitter.rules)
      updated = token_weighting.has_tokens(reduced.token_count)
      inner_carry, inner_reads = output.split(reduced, params)
      out, inner_state = choose(
          updated, _run_inner(emitter, output),
          lambda c, like: (output.skip(c[0], like[0]), c[1]),
          (inner_carry, carry.inner_state), inner_reads,
          output.inner_choice)
      return outputs.Emitted(out, inner_state, updated,
                             _stats_of(reduced, emitter.rules),
                             jnp.where(updated, reduced.token_count, 0.0))

  out, reads = output.split(cycle, emitter.params)
  init = outputs.Emitted(out, state.inner_state, jnp.bool_(False),
                         state.stats, jnp.zeros([], jnp.float32))
  return choose(emit, emitting,
                lambda c, like: c._replace(out=output.skip(c.out, like.out)),
                init, reads, output.emit_choice)


def _run_inner(emitter: Emitter, output: outputs.Output):
  """The emitting branch's body: ``inner`` on the carry's sum."""

  def run(carry, reads):
    out, inner_state = carry
    grad_sum, params = output.joined(out, reads)
    updates, inner_state = emitter.run(
        grad_sum, reads.token_count, reads.value_sums, inner_state,
        emitter.params if params is None else params)
    return output.made(updates, out), inner_state

  return run


def _stats_of(cycle: sum_layout.Cycle, rules) -> noise_scale.GradStats | None:
  """The noise statistics of a (device-reduced) cycle."""
  if cycle.stats_sums is None:
    return None
  # |mean|^2 from the sum in the accumulator's precision.
  count = jnp.where(cycle.token_count == 0, 1.0, cycle.token_count)
  mean_sq_norm = noise_scale.sq_norm(grad_reduction_lib.only_means(
      cycle.grad_sum, rules)) / jnp.square(count)
  return noise_scale.estimate_from_groups(
      [cycle.stats_sums], [mean_sq_norm], cycle.token_count)


