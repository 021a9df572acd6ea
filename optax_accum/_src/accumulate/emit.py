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

What the step hands back is its :class:`Output`, picked once by the entry
point (:func:`output_for`):

* :class:`Updates` (``tx.update``): the updates, zeros where none is made;
* :class:`UpdatesInSum` (``tx.update`` where the running sum's buffer holds
  the updates exactly: the single form): the sum's buffer, holding the
  updates where they were made and the sum where not; the updates handed
  back are ``where(updated, buffer, 0)``, fused by XLA into whatever adds
  them (no parameter-sized buffer of their own), and the next call discards
  the buffer either way (``microstep.add_to_sum``'s lazy reset);
* :class:`Applied` (``oa.update_and_apply``): the parameters, updated in
  place.

``inner.update`` is traced once per call: each branch is a nested
:func:`jax.jit`, traced once, whose trace the variants that
``lax.platform_dependent`` traces (a conditional, a loop) take from jit's
cache; XLA inlines the calls.
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import conditional_loops
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting

# The named scope of the emitting branch (oa.check_train_step finds it).
SCOPE = "optax_accum_emit"


class Emitted(NamedTuple):
  """What the emit decision hands back (and, in a loop, carries)."""

  out: Any  # the Output's: updates, the sum's buffer, or the parameters.
  inner_state: Any
  updated: jax.Array  # shape=(), bool: inner ran on a cycle with tokens.
  stats: noise_scale.GradStats | None  # this cycle's, or the previous ones.
  # shape=(), float32: the tokens the update's mean divided by, over every
  # device; 0 when none was made.
  tokens: jax.Array


# How choose chooses: a conditional; a loop of at most one trip on GPUs
# (conditional_loops.per_compiler), a conditional elsewhere; a loop.
COND, LOOP_ON_GPU, LOOP = "cond", "loop on GPU", "loop"


def choose(pred: jax.Array, made: Callable[[Any, Any], Any],
           skip: Callable[[Any, Any], Any], init: Any, reads: Any,
           how: str) -> Any:
  """``made(init, reads)`` where ``pred``, else ``skip(init, like)``.

  ``made`` is traced once (a nested :func:`jax.jit`, whose trace every
  variant reuses from jit's cache; XLA inlines the call); ``like`` is its
  output's types.
  ``how`` says how: :data:`COND`, or, where ``skip`` hands back ``init``
  (typed like ``made``'s output) and ``init`` rides in a loop's carry,
  :data:`LOOP_ON_GPU` or :data:`LOOP`.
  """
  made = jax.jit(made)  # traced once: every later call hits jit's cache.
  like = jax.eval_shape(made, init, reads)
  branched = lambda: lax.cond(pred, made, lambda i, r: skip(i, like), init,
                              reads)
  looped = lambda: conditional_loops.run_if(pred, made, init, reads)
  if how == COND:
    return branched()
  if how == LOOP:
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
    return updates, optax.tree.cast_like(new_state, inner_state)

  return Emitter(inner, params, extra_args, like_grads, rules, jax.jit(run))


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


class Output(Protocol):
  """What the emitting step hands back; what rides in its carry."""

  emit_choice: str  # how choose makes the emit choice: COND, LOOP...
  inner_choice: str  # and the choice to run inner (a cycle with tokens).

  def carried(self, cycle: sum_layout.Cycle, out: Any) -> Any:
    """The carry's value where no update is made (``out``: the outer
    carry's, or the parameters at the outer level)."""

  def reads(self, cycle: sum_layout.Cycle) -> sum_layout.Cycle:
    """What the branches read besides the carry."""

  def sum_of(self, carry: Any, read: Any) -> Any:
    """The running sum, from the carry or from what is read."""

  def params_of(self, carry: Any, params: Any) -> Any:
    """The parameters ``inner`` gets."""

  def made(self, updates: Any, carry: Any) -> Any:
    """The output where ``inner`` made ``updates``."""

  def skip(self, carry: Any, like: Any) -> Any:
    """The output where no update is made (``like``: ``made``'s types)."""

  def returned(self, emitted: Emitted, grad_sum: Any) -> tuple[Any, Any]:
    """What the call hands back, and the sum's buffer the state keeps."""


class Updates(NamedTuple):
  """``tx.update``'s: the updates, zeros where none is made."""

  emit_choice: str = COND
  inner_choice: str = COND

  def carried(self, cycle, out):
    del cycle, out

  def reads(self, cycle):
    return cycle

  def sum_of(self, carry, read):
    del carry
    return read

  def params_of(self, carry, params):
    del carry
    return params

  def made(self, updates, carry):
    del carry
    return updates

  def skip(self, carry, like):
    del carry
    return zeros_typed_like(like)

  def returned(self, emitted, grad_sum):
    return emitted.out, grad_sum


class UpdatesInSum(NamedTuple):
  """``tx.update``'s where the sum's buffer holds the updates exactly."""

  like_updates: Any  # ShapeDtypeStructs of inner's updates.
  # The sum in a loop's carry on GPUs (XLA copies a conditional's).
  emit_choice: str = LOOP_ON_GPU
  inner_choice: str = LOOP_ON_GPU

  def carried(self, cycle, out):
    del out
    return cycle.grad_sum

  def reads(self, cycle):
    return cycle._replace(grad_sum=None)  # in the carry alone: XLA copies
    # a buffer that is both carried and read.

  def sum_of(self, carry, read):
    del read
    return carry

  def params_of(self, carry, params):
    del carry
    return params

  def made(self, updates, carry):
    return jax.tree.map(lambda u, s: u.astype(s.dtype), updates, carry)

  def skip(self, carry, like):
    del like
    return carry

  def returned(self, emitted, grad_sum):
    del grad_sum
    updates = jax.tree.map(
        lambda s, u: jnp.where(emitted.updated, s.astype(u.dtype),
                               jnp.zeros([], u.dtype)),
        emitted.out, self.like_updates)
    return updates, emitted.out


class Applied(NamedTuple):
  """``oa.update_and_apply``'s: the parameters, updated where made."""

  # The parameters in a loop's carry, updated in place: on every compiler
  # for the emit (measured lower on TPU too: 80 against 96 MiB, adamw on 4
  # x f32[1024, 1024]), on GPUs for the inner (on TPU the loop peaked
  # higher at small sizes).
  emit_choice: str = LOOP
  inner_choice: str = LOOP_ON_GPU

  def carried(self, cycle, out):
    del cycle
    return out

  def reads(self, cycle):
    return cycle

  def sum_of(self, carry, read):
    del carry
    return read

  def params_of(self, carry, params):
    del params
    return carry

  def made(self, updates, carry):
    return optax.apply_updates(carry, updates)  # each in its param's dtype.

  def skip(self, carry, like):
    del like
    return carry

  def returned(self, emitted, grad_sum):
    return emitted.out, grad_sum


def output_for(apply: bool, layout: sum_layout.SumLayout, emitter: Emitter,
               cycle: sum_layout.Cycle, inner_state: Any) -> Output:
  """The output of one call, picked once.

  ``oa.update_and_apply``'s is :class:`Applied`; ``tx.update``'s is
  :class:`Updates`, or :class:`UpdatesInSum` where the emitting branch reads
  the sums as they are (the single form) and the sum's buffer holds the
  updates exactly. The updates' types are read off ``emitter.run``'s trace
  on the sums, the one trace of ``inner`` that the branches reuse.
  """
  if apply:
    return Applied()
  if not layout.local:
    return Updates()
  like_updates = jax.eval_shape(
      emitter.run, cycle.grad_sum, cycle.token_count, cycle.value_sums,
      inner_state, emitter.params)[0]
  if fits(like_updates, cycle.grad_sum):
    return UpdatesInSum(like_updates)
  return Updates()


def decide(emit: jax.Array, cycle: sum_layout.Cycle, state: Any,
           layout: sum_layout.SumLayout, emitter: Emitter,
           output: Output) -> Emitted:
  """The emitting branch where ``emit``, else the skipping one."""

  def emitting(carry: Emitted, reads: sum_layout.Cycle) -> Emitted:
    with jax.named_scope(SCOPE):
      cycle = reads._replace(grad_sum=output.sum_of(carry.out,
                                                    reads.grad_sum))
      reduced = layout.reduced(cycle, emitter.rules)
      updated = token_weighting.has_tokens(reduced.token_count)
      out, inner_state = choose(
          updated, _run_inner(emitter, output),
          lambda c, like: (output.skip(c[0], like[0]), c[1]),
          (output.carried(reduced, carry.out), carry.inner_state),
          output.reads(reduced), output.inner_choice)
      return Emitted(out, inner_state, updated,
                     _stats_of(reduced, emitter.rules),
                     jnp.where(updated, reduced.token_count, 0.0))

  init = Emitted(output.carried(cycle, emitter.params), state.inner_state,
                 jnp.bool_(False), state.stats, jnp.zeros([], jnp.float32))
  return choose(emit, emitting,
                lambda c, like: c._replace(out=output.skip(c.out, like.out)),
                init, output.reads(cycle), output.emit_choice)


def _run_inner(emitter: Emitter, output: Output):
  """The emitting branch's body: ``inner`` on the carry's sum."""

  def run(carry, reads):
    out, inner_state = carry
    updates, inner_state = emitter.run(
        output.sum_of(out, reads.grad_sum), reads.token_count,
        reads.value_sums, inner_state, output.params_of(out, emitter.params))
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


def fits(like_updates: Any, grad_sum: Any) -> bool:
  """Whether every update leaf can be kept in its sum leaf, exactly."""
  u_leaves, u_def = jax.tree.flatten(like_updates)
  s_leaves, s_def = jax.tree.flatten(grad_sum)
  if u_def != s_def or not u_leaves:
    return False
  return all(_leaf_fits(u, s) for u, s in zip(u_leaves, s_leaves))


def _leaf_fits(u, s) -> bool:
  u_dtype, s_dtype = jnp.dtype(u.dtype), jnp.dtype(s.dtype)
  if not (jnp.issubdtype(u_dtype, jnp.inexact)
          and jnp.issubdtype(s_dtype, jnp.inexact)):
    return False
  return (jnp.shape(u) == jnp.shape(s)
          and _holds(s_dtype, u_dtype)
          and readers.explicit_spec(u) == readers.explicit_spec(s)
          and axes.varying_axes(u) == axes.varying_axes(s))


def _holds(wide, narrow) -> bool:
  """Whether every value of dtype ``narrow`` casts to ``wide`` and back."""
  if wide == narrow:
    return True
  complex_ = jnp.issubdtype(wide, jnp.complexfloating)
  if complex_ != jnp.issubdtype(narrow, jnp.complexfloating):
    return False
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return (n.nmant <= w.nmant and n.maxexp <= w.maxexp
          and n.minexp >= w.minexp)


def zeros_typed_like(tree: Any) -> Any:
  """Zeros typed like ``tree``: same sharding, varying over the same axes.

  The two branches of a ``lax.cond`` must agree on both.

  Each leaf is filled from its own entry of a vector of zeros that an
  optimization barrier hides from XLA. Identical ``zeros`` of same-shaped
  leaves would be merged into one buffer by XLA's CSE, which a conditional
  then copies into each of its outputs: one extra read and write per leaf on
  every non-emitting call (36 MiB of copies per call for ten 4 MiB leaves).
  """
  leaves, treedef = jax.tree.flatten(tree)
  fills = lax.optimization_barrier(jnp.zeros(len(leaves), jnp.float32))

  def zeros_like(x, fill):
    zeros = jnp.zeros(x.shape, x.dtype, out_sharding=readers.explicit_spec(x))
    zeros = zeros + fill.astype(x.dtype)
    vma = tuple(sorted(axes.varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros

  return treedef.unflatten(
      [zeros_like(x, fills[i]) for i, x in enumerate(leaves)])
