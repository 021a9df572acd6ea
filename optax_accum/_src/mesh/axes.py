"""Manual axes: which values differ by device, and making them do so.

Inside :func:`jax.shard_map` every value has a type that says over which
manual axes it may differ from device to device (it *varies*). A value that
is the same on every device of an axis is *invariant* over it, and
:func:`jax.grad` sums the gradient with respect to such a value over the axis:
a collective on every call. Accumulation keeps each device's gradients local
until the one reduction per update, so it works with device-local (varying)
values. This module holds those type-level helpers.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers


def varying_axes(x: Any) -> frozenset[str]:
  """The manual axes over which ``x`` (or a ShapeDtypeStruct) may vary."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  return compat.varying_axes_of(aval)


def is_bound(axis_name: readers.AxisName) -> bool:
  """Whether ``axis_name`` names manual axes: inside shard_map or pmap."""
  try:
    for axis in readers.axes_of(axis_name):
      lax.axis_size(axis)
  except NameError:
    return False
  return True


def check_bound(axis_name: readers.AxisName) -> None:
  """Raises unless ``axis_name`` is a manual axis here (accumulate's case)."""
  if not is_bound(axis_name):
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: optax_accum.accumulate"
        " sums device-local gradients over it, so call tx.update inside"
        " jax.shard_map or jax.pmap over that axis, or under jax.jit with"
        " jax.set_mesh(mesh) (Explicit axes) on unreduced gradients from"
        " optax_accum.value_and_grad(..., gradient_sync='deferred'). Reduced"
        " gradients under plain jax.jit need axis_name=None."
    )


def device_local(tree: Any, axis_name: readers.AxisName) -> Any:
  """Marks every leaf as device-local (varying) over ``axis_name``.

  Inside :func:`jax.shard_map`, a value that is the same on every device of an
  axis (such as replicated parameters, ``in_specs=P()``) is *invariant* over
  it, and :func:`jax.grad` sums the gradient with respect to it over the axis,
  a collective on every call. The gradient with respect to a device-local copy
  stays on the device: no communication until you sum it yourself, e.g. with
  :func:`optax_accum.accumulate` ``(..., axis_name=...)`` once per update. The
  copy is free; leaves that are already varying are returned as they are.
  Under :func:`jax.pmap`, where gradients are always local, this does nothing.

  Args:
    tree: a pytree of arrays, typically the parameters.
    axis_name: the data-parallel axis (or axes) of the enclosing shard_map.

  Returns:
    ``tree`` with every leaf varying over ``axis_name``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((1,), ('data',),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def local_grad(w, x):  # no all-reduce: each device's own gradient
    ...   loss = lambda w: jnp.sum(w * x)
    ...   return jax.grad(loss)(oa.device_local(w, 'data'))
    >>> f = jax.shard_map(local_grad, mesh=mesh, in_specs=(P(), P('data')),
    ...                   out_specs=P('data'))
    >>> f(jnp.ones(2), jnp.array([1.0, 2.0]))
    Array([1., 2.], dtype=float32)
  """
  validation.check_axis_name(axis_name)
  if axis_name is None or not is_bound(axis_name):
    raise ValueError(
        f"oa.device_local(tree, axis_name={axis_name!r}): {axis_name!r} is"
        " not a manual axis here. Call it inside jax.shard_map (or"
        " jax.pmap) over that axis, on values whose gradient should stay on"
        " each device; under jax.jit the entry points need no device_local.")
  axes = readers.axes_of(axis_name)

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def varying_like(tree: Any, like: Any) -> Any:
  """``tree`` with each leaf varying over the axes its ``like`` leaf does.

  A scan's carry must keep its type: a leaf that ``loss_fn`` builds afresh
  (a counter of ``nnx.Rngs``) is invariant where the carried one, made
  device-local by the runner, varies.
  """

  def cast(x, model):
    missing = tuple(sorted(varying_axes(model) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

  if jax.tree.structure(tree) != jax.tree.structure(like):
    return tree  # the scan names the mismatch.
  return jax.tree.map(cast, tree, like)


def is_floating(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _tracks_varying(axis_name: readers.AxisName) -> bool:
  """Whether values here carry which manual axes they vary over.

  Inside :func:`jax.shard_map` with ``check_vma=True`` (the default) they
  do; under :func:`jax.pmap` or ``check_vma=False`` every value looks
  invariant, and nothing can be told from types.
  """
  probe = lax.pcast(jnp.zeros([]), readers.axes_of(axis_name), to="varying")
  return set(readers.axes_of(axis_name)) <= varying_axes(probe)


def check_device_local(name: str, tree: Any,
                       axis_name: readers.AxisName) -> None:
  """Raises if a leaf is invariant over ``axis_name`` where types tell."""
  if not _tracks_varying(axis_name):
    return
  wanted = set(readers.axes_of(axis_name))
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    missing = wanted - varying_axes(leaf)
    if missing:
      raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} is the same on every device of"
          f" axis {sorted(missing)} (invariant): autodiff has already summed"
          " it over the axis, and accumulate would sum it again when it"
          " emits, making the update as many times too large as there are"
          " devices. Take the gradient with respect to"
          f" optax_accum.device_local(params, {axis_name!r}) so that each"
          " device keeps its own."
      )


def check_same_on_every_device(
    name: str, value: jax.Array, axis_name: readers.AxisName
) -> None:
  """Raises if ``value`` may differ between devices of ``axis_name``.

  Only where types tell (inside :func:`jax.shard_map` with ``check_vma``).
  """
  if not _tracks_varying(axis_name):
    return
  varying = set(readers.axes_of(axis_name)) & varying_axes(value)
  if varying:
    raise ValueError(
        f"{name} varies over axis {sorted(varying)}: every device must make"
        " the same decision on the same call, since emitting sums over the"
        " axis. Compute it from values that are the same on every device"
        " (the step number, a host-side flag, or a jax.lax.psum of local"
        " counts)."
    )


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
    vma = tuple(sorted(varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros

  return treedef.unflatten(
      [zeros_like(x, fills[i]) for i, x in enumerate(leaves)])
