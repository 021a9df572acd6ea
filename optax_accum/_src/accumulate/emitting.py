"""The emitting branch of :func:`optax_accum.accumulate`.

On the call that ends a cycle, the running sums of this device (and, with
a data axis, of every device, in the one reduction per update that the
call's form says: a psum inside shard_map, a reshard under jit) become the
token-weighted mean that ``inner`` is run on; a cycle without tokens hands
back zero updates instead and leaves ``inner``'s state alone. Every other
call takes the skipping branch. Both are branches of a ``lax.cond`` that only
reads the running sum, so that XLA keeps a non-emitting call in place (see
``microstep.add_to_sum``). With ``apply`` (``oa.update_and_apply``) the
branches hand back the parameters, updated in the emitting one; the choice
is then a loop of at most one trip (``conditional_loops.run_if``), whose
carry XLA's GPU compiler updates in place where it copies a conditional's.
The reduction over the devices is the caller's, on the way into
:meth:`Emitter.emit` (each form's ``reduced``).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import conditional_loops
from optax_accum._src.accumulate import update_slot
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


def per_compiler(branched: Callable[[], Any], looped: Callable[[], Any]) -> Any:
  """``looped()`` on GPUs, ``branched()`` on TPU and CPU, by the platform
  the program is lowered for (``lax.platform_dependent``).

  For ``oa.update_and_apply``'s choice of running the inner optimizer, and
  for ``tx.update``'s where it keeps its updates in the sum's buffer
  (``update_slot``; ``oa.apply_if_updated`` then reads them the same way):
  on a TPU the loop peaked higher at small sizes (148 against 80 MiB, adamw,
  16 MiB of parameters), on the CPU it ran a k = 8 adamw cycle 1.7x slower.
  On a GPU a conditional copies what it passes through.
  """
  return lax.platform_dependent(tpu=branched, cpu=branched, default=looped)


class Cycle(NamedTuple):
  """The running sums of a cycle: what the conditional reads."""

  grad_sum: Any  # like params; per device under axis_name.
  token_count: jax.Array  # per device under axis_name.
  stats_sums: noise_scale.StatsSums | None  # None without with_stats.
  value_sums: window_args.ValueSums  # the window's value; per device too.


class Emitted(NamedTuple):
  """What either branch hands back."""

  updates: Any
  inner_state: Any
  updated: jax.Array  # shape=(), bool: inner ran on a cycle with tokens.
  stats: noise_scale.GradStats | None  # this cycle's, or the previous ones.
  # shape=(), float32: the tokens the update's mean divided by, over every
  # device; 0 when none was made.
  tokens: jax.Array


class Emitter(NamedTuple):
  """Runs ``inner`` on the cycle's mean, or hands back zero updates."""

  inner: optax.GradientTransformationExtraArgs
  params: Any
  extra_args: dict[str, Any]  # as given: see window_args.for_inner.
  like_grads: Any  # the gradients' tree: the mean takes their dtypes.
  like_updates: Any  # ShapeDtypeStructs of inner's updates.
  rules: list[str] | None  # grad_reduction per leaf; None: all "mean".
  # updates, grads -> the updates as returned (ZeRO's gather them).
  finish: Callable[[Any, Any], Any]
  # Whether the updates are applied to params (update_and_apply): then both
  # branches hand back the parameters, as they are when no update is made.
  apply: bool = False
  # Whether the updates are kept in the running sum's buffer (update_slot):
  # then both branches hand back that buffer, the sum where none is made.
  slot: bool = False

  def with_params(self, params) -> "Emitter":
    """The same emitter on ``params`` (a loop's carry, updated in place)."""
    return self._replace(params=params)

  def run_inner(self, grad_sum, token_count, value_sums, inner_state):
    mean = grad_reduction_lib.mean_by_rule(
        grad_sum, token_count, self.like_grads, self.rules)
    updates, new_state = self.inner.update(
        mean, inner_state, self.params,
        **window_args.for_inner(self.extra_args, value_sums, mean)
    )
    updates = self.finish(updates, self.like_grads)
    if self.slot:
      updates = update_slot.into(updates, grad_sum)
    if self.apply:  # each leaf in its parameter's dtype, as it was.
      updates = optax.apply_updates(self.params, updates)
    return updates, optax.tree.cast_like(new_state, inner_state)

  def skip_inner(self, grad_sum, token_count, value_sums, inner_state):
    del token_count, value_sums
    if self.apply:
      return self.params, inner_state
    if self.slot:
      return grad_sum, inner_state
    return zeros_typed_like(self.like_updates), inner_state

  def choose(self, updated, operands, inner_state):
    """``run_inner`` where ``updated``, else ``skip_inner``'s: a
    conditional, but with ``apply`` on GPUs a loop of at most one trip
    (:func:`per_compiler`), in which XLA keeps the inner state and
    the parameters in place.
    """

    def looped():
      init = self.skip_inner(*operands, inner_state)
      if self.slot:  # the sum in the carry alone, read and written in place.
        def body(carry, *reads):
          return self.run_inner(carry[0], *reads, carry[1])

        return conditional_loops.run_if(updated, body, init, *operands[1:])

      def body(carry, *reads):  # the parameters in the carry.
        return self.with_params(carry[0]).run_inner(*reads, carry[1])

      return conditional_loops.run_if(updated, body, init, *operands)

    def branched():
      return lax.cond(updated, self.run_inner, self.skip_inner, *operands,
                      inner_state)

    if not (self.apply or self.slot):
      return branched()
    return per_compiler(branched, looped)

  def emit(self, cycle: Cycle, inner_state, stats) -> Emitted:
    """The emitting branch, on a cycle already reduced over the devices."""
    del stats  # replaced by this cycle's.
    updated = token_weighting.has_tokens(cycle.token_count)
    updates, inner_state = self.choose(
        updated, (cycle.grad_sum, cycle.token_count, cycle.value_sums),
        inner_state)
    return Emitted(updates, inner_state, updated,
                   _stats_of(cycle, self.rules),
                   jnp.where(updated, cycle.token_count, 0.0))

  def skip(self, cycle: Cycle, inner_state, stats) -> Emitted:
    updates, inner_state = self.skip_inner(
        cycle.grad_sum, cycle.token_count, cycle.value_sums, inner_state
    )
    return Emitted(updates, inner_state, jnp.bool_(False), stats,
                   jnp.zeros([], jnp.float32))


def _stats_of(cycle: Cycle, rules) -> noise_scale.GradStats | None:
  """The noise statistics of a (device-reduced) cycle."""
  if cycle.stats_sums is None:
    return None
  # |mean|^2 from the sum in the accumulator's precision.
  count = jnp.where(cycle.token_count == 0, 1.0, cycle.token_count)
  mean_sq_norm = noise_scale.sq_norm(grad_reduction_lib.only_means(
      cycle.grad_sum, rules)) / jnp.square(count)
  return noise_scale.estimate_from_groups(
      [cycle.stats_sums], [mean_sq_norm], cycle.token_count)


def emitter(inner, reduced_grads, grads, inner_state, params, extra_args,
            rules=None, finish=lambda updates, grads: updates, apply=False):
  """The :class:`Emitter` of one ``update`` call.

  ``reduced_grads`` are the gradients as the reduced mean will be typed
  (shapes only), ``grads`` the incoming ones, whose dtypes the mean takes.
  With ``apply`` the branches hand back the parameters, updated in the
  emitting one (:func:`optax_accum.update_and_apply`).
  """
  finish = _in_params_layout(finish, params)
  like_updates = jax.eval_shape(
      lambda g, s: finish(inner.update(
          g, s, params, **window_args.for_inner(
              extra_args, window_args.zeros(lambda d: jnp.zeros([], d)), g)
      )[0], grads),
      reduced_grads, inner_state,
  )
  return Emitter(inner, params, extra_args, grads, like_updates, rules,
                 finish, apply)


def _in_params_layout(finish, params):
  """``finish``, each update then laid out as its parameter is.

  A state that its owner sharded over the data axes (an ``nnx.Optimizer``
  whose Variables carry Flax's ``optimizer_sharding``) makes sharded updates
  of replicated parameters: gathered here, in the emitting branch, once per
  update (ZeRO-1's all-gather), they leave the parameters as they were.
  """
  if params is None:
    return finish

  def like_param(u, p):
    if (p is None or readers.sharded_by_explicit_axes(u) is None
        or readers.unreduced_axes(p)
        or readers.plain_spec(u) == readers.plain_spec(p)):
      return u
    return jax.sharding.reshard(u, readers.plain_spec(p))

  return lambda updates, grads: jax.tree.map(
      like_param, finish(updates, grads), params)


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
