"""A mid-cycle state to save, each device's partial sum in its own slot.

Under jit with Explicit axes, :func:`optax_accum.accumulate` keeps the
running sum of unreduced gradients typed unreduced over the data axes
between calls (ZeRO-1 mid-cycle, the leaves ZeRO-2 keeps whole, any sum of
``gradient_sync="deferred"`` gradients): each device holds a partial that
no array shows whole, so orbax and ``np.asarray`` cannot read it. Reducing
it before the save (:func:`optax_accum.reduced_state`) changes the order in
which the emit later sums the partials, which can move the last bit.

:func:`checkpointable_state` instead lays each device's partial out in its
own slot of a leading axis over those data axes, ``P(axes, *its spec)``,
where it already lies: nothing moves. :func:`restored_state` hands each
device its slot back as its partial, so that the emit sums the same
partials in the same order as the run that never stopped.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


def _mesh_for(call: str) -> Any:
  """The mesh set with :func:`jax.set_mesh`, or our error naming ``call``."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.axis_names:
    raise ValueError(
        f"optax_accum.{call} reads and writes partial sums over the mesh's"
        " data axes: call it under jax.set_mesh(mesh), the mesh of the"
        " training step.")
  return mesh


def _is_abstract(x: Any) -> bool:
  return not isinstance(x, jax.Array)


def _abstract(shape: tuple[int, ...], dtype: Any, spec: P) -> Any:
  """A checkpoint target's leaf: laid out on the concrete mesh."""
  return jax.ShapeDtypeStruct(
      shape, dtype,
      sharding=jax.sharding.NamedSharding(jax.sharding.get_mesh(), spec))


def _slotted(x: Any, mesh: Any) -> Any:
  """One leaf: if unreduced, its partials along a new leading slot axis."""
  over = readers.unreduced_axes(x)
  if not over:
    if _is_abstract(x) and readers.mesh_of(x) is not None:
      return _abstract(x.shape, x.dtype, readers.plain_spec(x))
    return x
  axes = tuple(a for a in mesh.axis_names if a in over)
  spec = P(readers.entry(axes), *readers.partitions(readers.full_spec(x)))
  if _is_abstract(x):
    slots = math.prod(readers.axis_sizes(mesh)[a] for a in axes)
    return _abstract((slots, *x.shape), x.dtype, spec)
  # Under jax.jit: jax 0.9 runs no shard_map of unreduced arrays eagerly.
  return jax.jit(lambda x: manual.on_own_partials(
      lambda block: block[None], (x,), spec))(x)


def checkpointable_state(state: Any) -> Any:
  """``state`` with each unreduced running sum in per-device slots: to save.

  Each leaf typed unreduced over some mesh axes (a running sum of unreduced
  gradients under :func:`jax.jit`) becomes an array with one more, leading,
  axis over those axes (in the mesh's order), laid out ``P(axes, *its
  spec)``: device ``i`` of them holds its own partial sum in slot ``i``.
  This moves nothing (no collective), and orbax saves it like any sharded
  array. Every other leaf is returned as it is. Restore with
  :func:`optax_accum.restored_state`: the run then continues bit for bit
  as if it had never stopped.

  Given shapes (:func:`jax.eval_shape` of the training step's state), it
  returns the shapes of what it would save, laid out on the mesh set with
  :func:`jax.set_mesh`: the target of a restore in a new process.

  Call it under ``jax.set_mesh(mesh)``, the mesh of the training step,
  with or without :func:`jax.jit`.

  Args:
    state: an optimizer state (or any pytree holding one), or its shapes.

  Returns:
    ``state`` with no leaf typed unreduced.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Explicit,))
    >>> grad_fn = oa.value_and_grad(
    ...     lambda p, b: jnp.mean((b['x'] @ p['w']) ** 2), num_microbatches=1,
    ...     gradient_sync='deferred', equal_weights=True)
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=2, equal_weights=True)
    >>> with jax.set_mesh(mesh):
    ...   params = {'w': jnp.ones(3)}
    ...   batch = {'x': jax.device_put(jnp.ones((16, 3)), P('data'))}
    ...   _, grads = jax.jit(grad_fn)(params, batch)
    ...   _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    ...   saved = oa.checkpointable_state(state)  # under the mesh.
    >>> jax.typeof(state.grad_sum['w']), jax.typeof(saved.grad_sum['w'])
    (ShapedArray(float32[3]{U:data}), ShapedArray(float32[8@data,3]))
  """
  if not any(readers.unreduced_axes(x) or (
      _is_abstract(x) and readers.mesh_of(x) is not None)
             for x in jax.tree.leaves(state)):
    return state
  mesh = _mesh_for("checkpointable_state")
  return jax.tree.map(lambda x: _slotted(x, mesh), state)


def _unslotted(path: Any, saved: Any, like: Any, mesh: Any) -> Any:
  """One leaf: slots back to each device's partial, or as it is."""
  shape, like_shape = tuple(jnp.shape(saved)), tuple(jnp.shape(like))
  where = f"saved{jax.tree_util.keystr(path)}"
  if shape == like_shape:
    return saved
  if shape[1:] != like_shape:
    raise ValueError(
        f"{where} has shape {shape}, but like's leaf has shape {like_shape}:"
        " restore a checkpoint of optax_accum.checkpointable_state(state)"
        " into the state of the same transformation and parameters.")
  entries = readers.partitions(readers.full_spec(saved))
  axes = readers.axes_of(entries[0]) if entries and entries[0] else ()
  sizes = readers.axis_sizes(mesh)
  if not axes or any(a not in sizes for a in axes) or (
      math.prod(sizes[a] for a in axes) != shape[0]):
    raise ValueError(
        f"{where} holds {shape[0]} per-device partial sums, laid out"
        f" {readers.full_spec(saved)}, but this mesh {dict(sizes)} gives"
        " them no device each: restore the checkpoint of"
        " optax_accum.checkpointable_state on the data axes it was saved"
        " from, sharded as saved (the target: checkpointable_state of the"
        " state's shapes, under jax.set_mesh). To change the number of"
        " devices, save optax_accum.reduced_state(state) instead.")
  spec = P(*entries[1:], unreduced=set(axes))
  if _is_abstract(saved):
    return _abstract(shape[1:], saved.dtype, spec)
  return jax.jit(lambda saved: manual.on_own_partials(
      lambda block: block[0], (saved,), spec))(saved)


def restored_state(saved: Any, like: Any) -> Any:
  """A state restored from :func:`checkpointable_state`'s slots.

  Each leaf of ``saved`` with one more axis than the same leaf of ``like``
  holds per-device partial sums in slots: device ``i`` of the slot axis's
  mesh axes takes slot ``i`` back as its partial, typed unreduced over
  those axes, as the state was when it was saved. This moves nothing; the
  next update's emit sums exactly the partials, in the order, of the run
  that never stopped. Every other leaf is returned as it is.

  Call it under ``jax.set_mesh(mesh)`` of the same data axes (and sizes)
  as the save, with or without :func:`jax.jit`.

  Args:
    saved: what orbax restored of ``checkpointable_state(state)``.
    like: a state of the same transformation and parameters, or its shapes
      (``tx.init(params)`` or :func:`jax.eval_shape` of it): only its
      leaves' shapes are read.

  Returns:
    The state to continue training from.

  Examples:
    Without a mesh (or with nothing unreduced) the leaves come back as
    they are:

    >>> import jax, jax.numpy as jnp, optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.adam(0.1), every_k=4)
    >>> saved = oa.checkpointable_state(tx.init({'w': jnp.zeros(3)}))
    >>> like = jax.eval_shape(tx.init, {'w': jnp.zeros(3)})
    >>> oa.restored_state(saved, like) is saved
    True
  """
  if jax.tree.structure(saved) != jax.tree.structure(like):
    raise ValueError(
        "saved and like must have the same tree structure (the state saved"
        " and a state of the same transformation), got"
        f" {jax.tree.structure(saved)} and {jax.tree.structure(like)}.")
  if all(jnp.shape(s) == jnp.shape(x)
         for s, x in zip(jax.tree.leaves(saved), jax.tree.leaves(like))):
    return saved
  mesh = _mesh_for("restored_state")
  return jax.tree_util.tree_map_with_path(
      lambda path, s, x: _unslotted(path, s, x, mesh), saved, like)
