"""One ``update`` call of :func:`optax_accum.accumulate`, as stages in order.

The form, once (:func:`layout_for`, which also picks ``init``'s); the
micro-step added by its layout;
the emit decision (``every_k`` or the caller's ``emit``); the emitting step
(:mod:`emit`); the next state. :class:`Update` is the transformation's
``update``; ``AccumulateTransformation.update_and_apply`` runs the same
step with the parameters in the emitting branch.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._src import validation
from optax_accum._src.accumulate import emit as emit_lib
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import window_args
from optax_accum._src.accumulate import zero_sums
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.rules import token_weighting


def _cycle_length(
    every_k: int | Callable[[jax.Array], jax.Array] | None, count: jax.Array
) -> jax.Array | None:
  """Micro-steps in the cycle that ends with update number ``count + 1``.

  None when ``every_k`` is None: no cycle ends by count.
  """
  if every_k is None:
    return None
  if not callable(every_k):
    return jnp.asarray(every_k, jnp.int32)
  length = jnp.asarray(every_k(count))
  if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
    raise TypeError(
        "every_k(count) must return an integer scalar, got"
        f" {length.dtype}{list(length.shape)}."
    )
  return jnp.maximum(length.astype(jnp.int32), 1)


def _should_emit(emit, micro_step, length, layout):
  """The emit decision: the every_k rule OR the caller's ``emit``.

  ``emit`` can only end a cycle early, never hold one open: with
  ``emit=(i == last)`` every other call must still follow ``every_k``, or an
  epoch's updates silently collapse into one. ``length`` is None when
  ``every_k`` is None, and then ``emit`` alone decides.
  """
  by_count = jnp.bool_(False) if length is None else micro_step >= length
  if emit is None:
    return by_count
  emit = validation.check_predicate("emit", emit)
  layout.check_emit(emit)
  return emit | by_count


def layout_for(settings: sum_layout.UpdateSettings, params: Any,
               state: Any = None, updates: Any = None) -> sum_layout.SumLayout:
  """The form: where the running sums live (the one place it is decided).

  For ``init`` (``params``; no state nor gradients yet) by the settings
  (``axis_name``, ``shard_optimizer``) and the ``optimizer_sharding`` of
  Flax Variables in ``params``; for each ``update`` call (``updates`` and
  ``state``, at trace time) by the same settings, where the call runs and
  the gradients' types. Unreduced gradients for an ``inner`` state that
  came sharded over their axes take ZeRO-1 on its shards.
  """
  at_init = state is None
  typed = not at_init and typed_sums.is_typed(updates, state.grad_sum)
  zero, axis_name = settings.zero, settings.axis_name
  if zero is not None:
    zero_sums.check_mesh(zero.data_axes)
    base = typed_sums.TypedSums() if typed else local_sums.SingleSums()
    return zero_sums.ZeroSums(zero.data_axes, zero.gradient_sync, base)
  if axis_name is None:
    if at_init:
      return zero_sums.sharded_by_flax(params) or local_sums.SingleSums()
    if not typed:
      return local_sums.SingleSums()
    # Flax's optimizer_sharding is read off the inner state's shards: no
    # setting of ours says it (zero_sums.sharded_by_inner).
    return (zero_sums.sharded_by_inner(state.inner_state, updates,
                                       state.grad_sum)
            or typed_sums.TypedSums())
  if axes.is_bound(axis_name):
    return local_sums.ManualSums(axis_name)
  # axis_name under jit: init laid the state out in slots.
  return slot_sums.SlotSums(axis_name)


def missing_count(equal_weights: Any) -> token_weighting.MissingCount:
  """The count of an ``update`` call given no ``num_tokens``."""
  return token_weighting.MissingCount(
      "oa.accumulate",
      "num_tokens=n to each update call (n: the number of tokens that"
      " micro-batch's loss averaged over)",
      validation.check_bool("equal_weights", equal_weights),
  )


def _check_state_mesh(state: Any) -> None:
  """A state typed on one mesh, used under another, named (not JAX's
  "context mesh should match the aval mesh" from inside the emit)."""
  current = jax.sharding.get_abstract_mesh()
  meshes = [m for m in map(readers.mesh_of, jax.tree.leaves(state)) if m]
  if current.empty or not meshes:
    return
  if readers.axis_sizes(meshes[0]) != readers.axis_sizes(current):
    raise ValueError(
        "tx.update's state was laid out on a mesh of axes"
        f" {readers.axis_sizes(meshes[0])}, and this call runs under"
        f" {readers.axis_sizes(current)}: a state moves to another mesh"
        " through a checkpoint: save oa.reduced_state(state) (under the old"
        " mesh, in jax.jit) and restore it under the new one, or start from"
        " tx.init(params) under the new mesh.")


def _check_manual_axes(updates: Any, params: Any, grad_sum: Any,
                       axis_name: Any) -> None:
  """Gradients of each device's own inside a shard_map, with nothing to
  sum them: named, not JAX's "cond branches must have equal output types"
  from inside the emit."""
  if axis_name is not None:
    return
  held = frozenset().union(*map(axes.varying_axes, jax.tree.leaves(
      (params, grad_sum))))
  own = frozenset().union(*map(axes.varying_axes, jax.tree.leaves(updates)))
  if own - held:
    names = tuple(sorted(own - held))
    name = names[0] if len(names) == 1 else names
    raise ValueError(
        f"the gradients vary over the manual axes {names} of a shard_map"
        " (each device's own), but oa.accumulate was given no axis_name to"
        " sum them over: pass oa.accumulate(..., axis_name="
        f"{name!r}), which reduces once per update, or psum the gradients"
        " first.")


def _check_params(params: Any, grad_sum: Any, slots: bool) -> None:
  """``params`` must be the tree the state was made for, leaf by leaf."""
  if params is None:
    return
  start = 1 if slots else 0
  validation.check_same_structure(
      "params", params,
      jax.tree.map(lambda s: jax.ShapeDtypeStruct(jnp.shape(s)[start:],
                                                  s.dtype), grad_sum),
      "the params the state was built for (tx.init(params))")


class Step(NamedTuple):
  """One ``update`` call of :func:`accumulate`, with its settings: the
  updates, or with ``apply`` the parameters they make (applied in the
  emitting branch, :func:`optax_accum.update_and_apply`), and the state."""

  inner: optax.GradientTransformationExtraArgs
  every_k: Any
  settings: sum_layout.UpdateSettings
  takes_extra_args: bool
  value_fn_over_window: bool
  missing_count: token_weighting.MissingCount

  def __call__(self, updates, state, params, num_tokens, emit, extra_args,
               apply):
    state_lib.check_state(updates, state, params)
    _check_state_mesh(state)
    _check_manual_axes(updates, params, state.grad_sum,
                       self.settings.axis_name)
    validation.refuse_near_misses(extra_args, ("num_tokens", "emit"))
    if extra_args and not self.takes_extra_args:
      validation.refuse_extra_args("inner", extra_args)
    layout = layout_for(self.settings, params, state, updates)
    if num_tokens is None:
      tokens = self.missing_count.count()  # warned once the call is checked.
    else:
      tokens = validation.as_token_count("num_tokens", num_tokens)
    incoming = sum_layout.Incoming(
        updates, num_tokens, tokens,
        window_args.checked_value(extra_args, self.value_fn_over_window))
    step = layout.add(incoming, state, params, self.settings)
    # The updates are checked against the state first (layout.add), then
    # the params: a mistake in both is named where it starts.
    _check_params(params, state.grad_sum,
                  self.settings.axis_name is not None)
    micro_step = optax.safe_increment(state.micro_step)
    emit = _should_emit(
        emit, micro_step, _cycle_length(self.every_k, state.count), layout)
    emitter = emit_lib.emitter(self.inner, params, extra_args, step.grads,
                               step.leaf_rules)
    try:
      output = emit_lib.output_for(apply, layout, emitter, step.cycle,
                                   state.inner_state)
      emitted = emit_lib.decide(emit, step.cycle, state, layout, emitter,
                                output)
    except compat.sharding_type_error() as e:
      if self.settings.zero is not None:
        zero_sums.note_for_matrices(e)
      raise
    returned, grad_sum = output.returned(emitted, step.cycle.grad_sum)
    new_state = state_lib.next_state(state, micro_step, emit, step, emitted,
                                     grad_sum)
    if num_tokens is None:
      self.missing_count.warn()
    if not apply:
      state_lib.remember_updates(new_state, returned)
    return returned, new_state


class Update:
  """:func:`accumulate`'s ``update``: ``(grads, state, params=None, *,
  num_tokens=None, emit=None, **extra_args) -> (updates, state)``."""

  __slots__ = ("__weakref__", "step")

  def __init__(self, step: Step):
    self.step = step

  def __call__(self, updates, state, params=None, *, num_tokens=None,
               emit=None, **extra_args):
    return self.step(updates, state, params, num_tokens, emit, extra_args,
                     False)
