"""``accumulate`` on unreduced gradients under jit: the sum kept unreduced.

With one jit call per micro-batch (PyTorch DDP's ``no_sync`` loop), a
gradient typed *unreduced* over the data axes (``float32[...]{U:data}``, as
:func:`optax_accum.value_and_grad` ``(..., gradient_sync="deferred")``
returns it on a mesh with Explicit axes) holds each device's partial: summed
over the devices it is the batch's gradient. Its type says all there is to
know, so :func:`optax_accum.accumulate` needs no ``axis_name`` for it and no
layout of its own at ``init``: the state's sum is an array shaped and
sharded like its parameter, and from the first such call on it is typed
unreduced over the same axes as the gradient, across jit calls. Each call
adds ``num_tokens * g`` (``num_tokens`` the batch's global count, a
replicated scalar) on each device's own partial, with no gradient-sized
communication; the emitting branch reshards the sum to its parameter's
sharding, the one reduction per update (an all-reduce; over the axes that
shard the parameter, FSDP, nothing is left: JAX reduce-scattered those in
the call that took the gradient).

A sum that is typed like its parameter (a fresh state, or one saved with
:func:`optax_accum.reduced_state`) holds the whole value: it enters the
unreduced sum on the first device of the axes and as zeros on the others,
which is exact and moves nothing. A gradient typed like its parameter (JAX
already reduced it) enters the same way.
"""

from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


class LeafTypes(NamedTuple):
  """How one leaf's sum and gradient are typed in a call."""

  over: tuple[str, ...]  # the axes the new sum is unreduced over.
  sum_is_partial: bool  # the stored sum is typed unreduced over ``over``.
  grad_is_partial: bool  # the gradient is typed unreduced over ``over``.


def is_typed(updates: Any, grad_sum: Any) -> bool:
  """Whether any gradient or stored sum is typed unreduced."""
  return any(readers.unreduced_axes(x)
             for x in jax.tree.leaves((updates, grad_sum)))


def leaf_types(updates: Any, grad_sum: Any) -> list[LeafTypes]:
  """Each leaf's :class:`LeafTypes`, or an error naming the leaf."""
  types = []
  flat = jax.tree_util.tree_leaves_with_path(updates)
  for (path, g), s in zip(flat, jax.tree.leaves(grad_sum)):
    have, kept = readers.unreduced_axes(g), (
        readers.unreduced_axes(s))
    where = f"updates{jax.tree_util.keystr(path)}"
    if have and kept and have != kept:
      raise ValueError(
          f"{where} is unreduced over {sorted(have)}, but the running sum"
          f" of this cycle is unreduced over {sorted(kept)}: every call of"
          " a cycle must take its gradients from the same mesh axes (the"
          " same gradient_sync='deferred' value_and_grad)."
      )
    if kept and readers.partitions(readers.full_spec(g)) != (
        readers.partitions(readers.full_spec(s))):
      raise ValueError(
          f"{where} is typed {jax.typeof(g)}, sharded unlike the running"
          f" sum kept for it ({jax.typeof(s)}, the parameter's sharding"
          " at tx.init): take the gradient with respect to parameters"
          " sharded as they were when the state was made."
      )
    over = tuple(sorted(have | kept))
    types.append(LeafTypes(over, bool(kept), bool(have)))
  return types


def check_axis_name_matches(types: list[LeafTypes], axis_name: Any) -> None:
  """An ``axis_name`` given as well must name the axes the types say."""
  if axis_name is None:
    return
  named = set(axis_name if isinstance(axis_name, tuple) else (axis_name,))
  typed = set().union(*(t.over for t in types))
  if not typed <= named:
    raise ValueError(
        f"accumulate(axis_name={axis_name!r}) got gradients unreduced over"
        f" {sorted(typed)}, mesh axes it does not name. Under jax.jit the"
        " gradients' types say which axes to reduce over: leave axis_name"
        " out (axis_name is for a manual axis, inside jax.shard_map or"
        f" jax.pmap), or pass axis_name={tuple(sorted(typed))!r}."
    )


def _laid_out_like(sums: list[Any], grads: list[Any],
                   types: list[LeafTypes]) -> list[Any]:
  """Whole sums resharded like their gradients (a slice, no reduction)."""
  return [
      s if t.sum_is_partial or readers.partitions(readers.full_spec(s))
      == readers.partitions(readers.full_spec(g))
      else jax.sharding.reshard(s, P(*readers.partitions(
          readers.full_spec(g))))
      for s, g, t in zip(sums, grads, types)
  ]


def add_partials(updates: Any, state: Any, params: Any, tokens: jax.Array,
                 settings: sum_layout.UpdateSettings,
                 value: jax.Array | None) -> sum_layout.MicroStep:
  """Adds a micro-step's unreduced gradients, on each device's partials.

  The non-finite decision is global (one scalar reduction);
  ``should_skip`` runs under jit on the gradients and the state as they
  are.
  """
  types = leaf_types(updates, state.grad_sum)
  check_axis_name_matches(types, settings.axis_name)
  skip = microstep.skipped_on_partials(settings.should_skip, updates, state,
                                       params)
  mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names)

  def local(grads, sums, tokens, skip, cycle_start):
    # A whole value (a sum typed like its parameter, a reduced gradient)
    # enters the partials on the first device only: summed, it counts once.
    sums = [manual.on_first_device(s, t.over)
            if t.over and not t.sum_is_partial else s
            for s, t in zip(sums, types)]
    grads = [manual.on_first_device(g, t.over)
             if t.over and not t.grad_is_partial else g
             for g, t in zip(grads, types)]
    return microstep.add_on_device(grads, sums, tokens, skip, cycle_start,
                                   settings, mesh_axes)

  grads = jax.tree.leaves(updates)
  sums = _laid_out_like(jax.tree.leaves(state.grad_sum), grads, types)
  sum_specs = [P(*readers.partitions(readers.full_spec(s)),
                 unreduced=set(t.over)) for s, t in zip(sums, types)]
  added = manual.on_own_partials(
      local,
      (grads, sums, tokens, skip, state.micro_step == 0),
      microstep.DeviceAdd(sum_specs, P(), P(), P()),
  )
  return sum_layout.MicroStep(
      grads=updates,
      leaf_rules=None,  # all "mean": check_partials_settings refuses others.
      cycle=sum_layout.Cycle(
          grad_sum=jax.tree.unflatten(jax.tree.structure(state.grad_sum),
                                      added.sums),
          token_count=state.token_count + added.tokens,
          stats_sums=None,
          # value and tokens are global (replicated) under jit.
          value_sums=window_args.add(state.value_sums, value,
                                     added.kept_weight, added.tokens),
      ),
      nonfinite_count=microstep.increment_where(added.nonfinite,
                                                state.nonfinite_count),
      skipped_count=microstep.increment_where(skip, state.skipped_count),
  )


def reduce_sum(s: jax.Array) -> jax.Array:
  """A running sum reduced to its parameter's sharding: the one reduction
  (a psum of each device's partial, 16-bit floats summed in float32)."""
  if not readers.unreduced_axes(s):
    return s
  return collectives.reduce_scatter_unreduced(s, readers.plain_spec(s))


class TypedSums(NamedTuple):
  """Under jit, unreduced gradients: the sum kept unreduced, by type."""

  local: bool = False

  def init(self, inner, params, settings):
    # Typed like the parameters; the first unreduced call retypes the sum.
    return sum_layout.whole(inner.init(params), params, settings)

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    grads = microstep.checked_grads(incoming.grads, state.grad_sum, None)
    microstep.check_partials_settings(grads, settings)
    return add_partials(grads, state, params, incoming.tokens, settings,
                        incoming.value)

  def reduced(self, cycle, rules):
    del rules
    return cycle._replace(grad_sum=jax.tree.map(reduce_sum, cycle.grad_sum))

  def check_emit(self, emit):
    del emit  # a jit-level value: the same on every device by its type.
