"""The specs of :func:`optax_accum.accumulate`'s state, and a state reduced.

Opt-in, off the hot path: :func:`state_partition_specs` lays a state out for
a ``jax.shard_map``'s specs or a checkpoint's target; :func:`reduced_state`
reduces the running sums kept unreduced (a mid-cycle save to restore on
another number of devices; ``saved_state.py`` saves them as they are).
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import validation
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import state_access
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.mesh import readers


def _slot_spec(param_spec: P, slots: Any, slot: readers.AxisName,
               from_type: bool) -> P:
  """A running sum's spec: its slot axis, then its parameter's spec.

  A sum made under a mesh with Explicit axes carries its spec in its type
  (for a parameter sharded over some data axes, FSDP/HSDP, its slots span
  only the others): without ``param_specs``, that spec over the data axes
  is the answer. Other mesh axes (a model axis) are left out, as the
  parameters' are: a shard_map over the data axes alone refuses specs that
  name them, and one over every axis then holds the parameters whole.
  """
  typed = readers.explicit_spec(slots) if from_type else None
  if typed is None:
    return P(slot, *param_spec)
  typed_slots = set(readers.axes_of(typed[0])) - {None} if typed else set()
  if typed_slots - set(readers.axes_of(slot)):
    raise ValueError(
        f"axis_name={slot!r}, but the state's running sums keep their"
        f" per-device slots over {sorted(typed_slots)} (their type is"
        f" {typed}): pass the axis_name given to optax_accum.accumulate.")
  return readers.restrict(typed, slot)


def _param_spec_tree(param_specs: Any, grad_sum: Any) -> Any:
  """Each parameter's spec, as a tree shaped like the parameters."""
  if param_specs is None:
    return jax.tree.map(lambda _: P(), grad_sum)
  if isinstance(param_specs, P):
    return jax.tree.map(lambda _: param_specs, grad_sum)
  try:
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(lambda _: spec, sub),
        param_specs,
        grad_sum,
        is_leaf=lambda x: isinstance(x, P) or x is None,
    )
  except ValueError as e:
    raise ValueError(
        "param_specs must be a PartitionSpec or a tree of them that is a"
        " prefix of the parameters' tree"
        f" {jax.tree.structure(grad_sum)}: {e}") from None


def _check_args(state: Any, axis_name: Any, param_specs: Any) -> list[Any]:
  """The state's AccumulateStates, or our error naming a bad argument."""
  validation.check_axis_name(axis_name)
  is_spec = lambda x: isinstance(x, P) or x is None
  bad = [x for x in jax.tree.leaves(param_specs, is_leaf=is_spec)
         if not is_spec(x)]
  if bad:
    raise TypeError(
        "param_specs must be None, a PartitionSpec or a tree of them (a"
        f" prefix of the parameters' tree), got {param_specs!r}.")
  if axis_name is None and param_specs is not None:
    raise ValueError(
        "param_specs is read only with axis_name (the specs of the per-device"
        " slots' parameters); without it each leaf's spec is read off the"
        " state's type: make the state under jax.set_mesh from sharded"
        " parameters (or jax.eval_shape of tx.init on them).")
  states = state_access.accumulate_states(state, "state")
  for found in states if axis_name is not None else ():
    if jnp.ndim(found.token_count) != 1:
      raise ValueError(
          f"axis_name={axis_name!r}, but the state holds no per-device slots"
          " (its token_count has shape"
          f" {jnp.shape(found.token_count)}): it was built by"
          " optax_accum.accumulate without axis_name. Call"
          " state_partition_specs(state) without axis_name, or build"
          " accumulate with the axis_name of its shard_map.")
  return states


def state_partition_specs(
    state: Any,
    axis_name: readers.AxisName | None = None,
    param_specs: Any = None,
) -> Any:
  """``PartitionSpec``\\ s for an optimizer state holding per-device sums.

  With ``axis_name``, the state of :func:`optax_accum.accumulate` keeps each
  device's partial sum of gradients and tokens (``grad_sum``,
  ``token_count``) along a leading slot axis, one slot per device. These
  partial sums differ from device to device: they must be laid out as
  ``P(axis_name)`` in :func:`jax.shard_map`'s ``in_specs`` and ``out_specs``
  (``P()`` would keep one device's sum and silently drop the others'). This
  returns a tree of specs shaped like ``state``: the partial sums get
  ``P(axis_name, *param_spec)``; every subtree shaped like the parameters
  (the inner optimizer's moments, say) gets ``param_specs``; the rest (counts,
  flags) is replicated, ``P()``.

  ``tx.init(params)`` called under ``jax.set_mesh(mesh)``, outside the
  shard_map, makes the state with one slot per device of ``axis_name``,
  already sharded as these specs say; called inside the shard_map it makes
  this device's one slot. The same state serves ``tx.update`` under plain
  :func:`jax.jit` on unreduced gradients (``gradient_sync="deferred"``);
  there, with Explicit axes, a sum's slots span only the data axes that do
  not shard its parameter, and its spec is read off its type. Specs name
  only the axes of ``axis_name`` and of ``param_specs``: a parameter's
  sharding over another mesh axis that is not manual in the shard_map (a
  ``model`` axis left to the types, ``axis_names={"data"}``) stays with the
  types.

  Without ``axis_name`` (a state of ``accumulate`` built without one) there
  are no slots: each leaf's spec is read off its type (``P()`` where it has
  none), for checkpoint targets. A running sum typed unreduced (unreduced
  gradients under jit) has no such spec: save
  :func:`optax_accum.checkpointable_state` of it instead.

  Args:
    state: an optimizer state containing an :class:`AccumulateState` (or
      several), or its shape (``jax.eval_shape(tx.init, params)``).
    axis_name: the data-parallel axis (or axes) given to ``accumulate``, or
      None.
    param_specs: the parameters' specs in the same shard_map: a single spec
      for all of them or a tree of specs (a prefix of the parameters' tree).
      None means replicated (``P()``).

  Returns:
    A tree of :class:`jax.sharding.PartitionSpec` with the structure of
    ``state``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from jax.sharding import PartitionSpec as P
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=4, axis_name='data')
    >>> specs = oa.state_partition_specs(
    ...     jax.eval_shape(tx.init, {'w': jnp.zeros(3)}), 'data')
    >>> specs.grad_sum, specs.token_count, specs.count
    ({'w': P('data',)}, P('data',), P())
  """
  states = _check_args(state, axis_name, param_specs)
  if axis_name is None:
    return _typed_specs(state)
  is_state = lambda x: isinstance(x, state_lib.AccumulateState)
  grad_sum = states[0].grad_sum
  slot = axis_name

  spec_tree_for = lambda grad_sum: _param_spec_tree(param_specs, grad_sum)

  def like_params(node, grad_sum):
    """Whether ``node`` is a tree shaped like the parameters."""
    if jax.tree.structure(node) != jax.tree.structure(grad_sum):
      return False
    return all(
        jnp.shape(leaf) == jnp.shape(s)[1:]
        for leaf, s in zip(jax.tree.leaves(node), jax.tree.leaves(grad_sum))
    )

  def specs_of(node, grad_sum, param_tree):
    """Specs for a subtree outside the partial sums."""
    if like_params(node, grad_sum):
      return param_tree
    if is_state(node):
      return specs_of_state(node)
    children, treedef = jax.tree_util.tree_flatten(
        node, is_leaf=lambda x: x is not node
    )
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a leaf
      return P()
    return treedef.unflatten(
        [specs_of(child, grad_sum, param_tree) for child in children]
    )

  def specs_of_state(node):
    param_tree = spec_tree_for(node.grad_sum)
    fields = {
        name: specs_of(value, node.grad_sum, param_tree)
        for name, value in node._asdict().items()
    }
    fields["grad_sum"] = jax.tree.map(
        lambda spec, s: _slot_spec(spec, s, slot, param_specs is None),
        param_tree, node.grad_sum, is_leaf=lambda x: isinstance(x, P),
    )
    for name in state_lib.PER_DEVICE_COUNTS:
      fields[name] = jax.tree.map(
          lambda x: P(slot) if jnp.ndim(x) == 1 else P(), getattr(node, name)
      )
    return type(node)(**fields)

  return specs_of(state, grad_sum, spec_tree_for(grad_sum))


def _typed_specs(state: Any) -> Any:
  """Each leaf's spec read off its type: a state without slots."""

  def spec(path, x):
    full = readers.full_spec(x)
    if full.unreduced:
      raise ValueError(
          f"state{jax.tree_util.keystr(path)} is typed {jax.typeof(x)}:"
          " unreduced over the data axes (the running sum of unreduced"
          " gradients under jit), which has no partition spec to save or"
          " restore. Save optax_accum.checkpointable_state(state) instead"
          " (each device's partial sum in its own slot, nothing moves) and"
          " restore it with optax_accum.restored_state: accumulate resumes"
          " bit for bit. To restore on another number of devices, save"
          " optax_accum.reduced_state(state) (one all-reduce, under"
          " jax.jit; it resumes to float32 rounding)."
      )
    entries = list(readers.partitions(full))
    while entries and entries[-1] is None:
      entries.pop()
    return P(*entries)

  return jax.tree_util.tree_map_with_path(spec, state)


def reduced_state(state: Any) -> Any:
  """``state`` with every running sum typed unreduced reduced: to save.

  Under jit with Explicit axes, :func:`optax_accum.accumulate` keeps the
  running sum of unreduced gradients (``gradient_sync="deferred"``) typed
  unreduced over the data axes across calls: each device's partial sum.
  Such an array cannot be fetched or saved. This reshards each of them to
  its parameter's sharding (one all-reduce, so call it under
  :func:`jax.jit`); every other leaf is returned as it is. ``accumulate``
  resumes from the result to float32 rounding: the next call puts each whole
  sum back on one device of the data axes, zeros on the others, which moves
  nothing, but the emit then sums the partials in another order. For a
  mid-cycle checkpoint that resumes bit for bit, with no collective, save
  :func:`optax_accum.checkpointable_state` instead; this one serves a
  restore on another number of devices.

  Args:
    state: an optimizer state (or any pytree) holding
      :class:`AccumulateState`\\ s.

  Returns:
    ``state`` with no leaf typed unreduced.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=4)
    >>> state = tx.init({'w': jnp.zeros(3)})
    >>> saved = jax.jit(oa.reduced_state)(state)  # nothing unreduced here.
    >>> bool(jnp.all(saved.grad_sum['w'] == state.grad_sum['w']))
    True
  """
  return jax.tree.map(typed_sums.reduce_sum, state)
