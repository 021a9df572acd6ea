"""Data parallelism: partial sums stay on each device until summed once.

Gradient accumulation over ``n`` devices should communicate once per optimizer
update. Each device keeps the sum of its own micro-batches' gradients (its
*partial sum*) and the partial sums are added over the data-parallel axis once,
when the update is made. This module holds the pieces that make that work under
:func:`jax.shard_map`, :func:`jax.pmap` and plain :func:`jax.jit` over a mesh.
"""

from collections.abc import Sequence
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...]


def axes_of(axis_name: AxisName) -> tuple[str, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def varying_axes(x: Any) -> frozenset[str]:
  """The manual axes over which ``x`` (or a ShapeDtypeStruct) may vary."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  vma = getattr(aval, "vma", None)  # jax < 0.9.
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma)


def is_bound(axis_name: AxisName) -> bool:
  """Whether ``axis_name`` names manual axes: inside shard_map or pmap."""
  try:
    for axis in axes_of(axis_name):
      lax.axis_size(axis)
  except NameError:
    return False
  return True


def mesh_axis_size(axis_name: AxisName) -> int | None:
  """The size of ``axis_name`` in the current mesh, if all its axes are there.

  Manual axes (inside :func:`jax.shard_map`) do not count: there each device
  holds one slot.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  sizes = dict(mesh.shape)
  manual = set(getattr(mesh, "manual_axes", ()))
  axes = axes_of(axis_name)
  if any(a not in sizes or a in manual for a in axes):
    return None
  return math.prod(sizes[a] for a in axes)


def _all_explicit(axis_name: AxisName) -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return all(types.get(a) == AxisType.Explicit for a in axes_of(axis_name))


def device_local(tree: Any, axis_name: AxisName) -> Any:
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
  axes = axes_of(axis_name)

  def cast(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def partial_zeros(shape: Sequence[int], dtype: Any, axis_name: AxisName):
  """Zeros for per-device partial sums: ``shape`` behind a leading slot axis.

  Inside shard_map or pmap each device has one slot. Under a mesh
  (:func:`jax.set_mesh`) with ``axis_name`` the slot axis has one slot per
  device and is sharded over it, ready for the ``in_specs`` that
  :func:`optax_accum.state_partition_specs` gives. With neither, one slot:
  replicate it for pmap.
  """
  shape = tuple(shape)
  slots = None if is_bound(axis_name) else mesh_axis_size(axis_name)
  if slots is None:
    return jnp.zeros((1,) + shape, dtype)
  spec = P(axis_name)
  if _all_explicit(axis_name):
    return jnp.zeros((slots,) + shape, dtype, out_sharding=spec)
  return lax.with_sharding_constraint(jnp.zeros((slots,) + shape, dtype), spec)


def _check_bound(axis_name: AxisName) -> None:
  if not is_bound(axis_name):
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here: optax_accum.accumulate"
        " sums device-local gradients over it, so call tx.update inside"
        " jax.shard_map or jax.pmap over that axis. Under plain jax.jit the"
        " gradients are already global: use axis_name=None, or"
        " optax_accum.value_and_grad(..., axis_name=...) for one reduction"
        " per step."
    )


def sum_partials(tree: Any, axis_name: AxisName) -> Any:
  """Sums per-device partial sums (with a leading slot axis) over an axis."""
  _check_bound(axis_name)
  return lax.psum(
      jax.tree.map(lambda x: x.reshape(x.shape[1:]), tree), axis_name
  )


def _explicit_spec(x: Any) -> P | None:
  """The spec of ``x``'s type if it is sharded over Explicit mesh axes."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  names = [n for e in spec if e is not None for n in axes_of(e)]
  mesh = sharding.mesh
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if names and all(types.get(n) == AxisType.Explicit for n in names):
    return spec
  return None


def like_summed(tree: Any, axis_name: AxisName | None) -> Any:
  """``tree`` summed over the axis: for shapes (eval_shape) only."""
  if axis_name is None:
    return tree
  _check_bound(axis_name)
  return lax.psum(tree, axis_name)


def zeros_like_partials(tree: Any) -> Any:
  """Zeros typed like ``tree``: same sharding, varying over the same axes.

  The two branches of a ``lax.cond`` must agree on both.
  """

  def zeros_like(x):
    zeros = jnp.zeros(x.shape, x.dtype, out_sharding=_explicit_spec(x))
    vma = tuple(sorted(varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros

  return jax.tree.map(zeros_like, tree)


def _is_floating(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def mean_of_floats(tree: Any, axis_name: AxisName) -> Any:
  """Averages the floating leaves of ``tree`` over the axis (model state)."""
  return jax.tree.map(
      lambda x: lax.pmean(x, axis_name) if _is_floating(x) else x, tree
  )


def floats_device_local(tree: Any, axis_name: AxisName) -> Any:
  """Marks the floating leaves of ``tree`` as device-local over the axis."""
  return jax.tree.map(
      lambda x: device_local(x, axis_name) if _is_floating(x) else x, tree
  )


def spec_over(x: Any, axis_name: AxisName) -> P:
  """The part of ``x``'s sharding that is over ``axis_name``, as a spec.

  Only explicitly sharded arrays (``AxisType.Explicit`` meshes) carry their
  sharding in their type; other arrays give ``P()``.
  """
  axes = set(axes_of(axis_name))
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return P()
  entries = []
  for entry in spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if isinstance(n, str) and n in axes)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _sharded_dims(spec: P) -> list[tuple[int, tuple[str, ...]]]:
  return [(d, axes_of(e)) for d, e in enumerate(spec) if e is not None]


def gather(x: Any, spec: P) -> Any:
  """The whole array from this device's shard of it, laid out by ``spec``."""
  for dim, axes in _sharded_dims(spec):
    x = lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim,
                       tiled=True)
  return x


def sum_into_shards(
    tree: Any, specs: Any, extra: Any, axis_name: AxisName
) -> tuple[Any, Any]:
  """Sums ``tree`` over ``axis_name``, each leaf into its shard by ``specs``.

  A leaf whose spec shards it over the axis is reduce-scattered (each device
  keeps the sum of its own shard); the others, and ``extra``, are all-reduced
  together.

  Returns:
    ``(summed tree, summed extra)``.
  """
  axes = axes_of(axis_name)
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  to_psum = []
  out = [None] * len(leaves)
  for i, (leaf, spec) in enumerate(zip(leaves, spec_leaves)):
    used = set()
    for dim, dim_axes in _sharded_dims(spec):
      leaf = lax.psum_scatter(
          leaf, dim_axes if len(dim_axes) > 1 else dim_axes[0],
          scatter_dimension=dim, tiled=True,
      )
      used.update(dim_axes)
    rest = tuple(a for a in axes if a not in used)
    if used and rest:
      leaf = lax.psum(leaf, rest)
    if used:
      out[i] = leaf
    else:
      to_psum.append(i)
  summed, extra = lax.psum(([leaves[i] for i in to_psum], extra), axis_name)
  for i, leaf in zip(to_psum, summed):
    out[i] = leaf
  return treedef.unflatten(out), extra


def _without_axes(x: Any, axis_name: AxisName, leading: bool) -> Any:
  """Reshards an explicitly sharded ``x`` to ``P(axis_name)`` or replicated.

  With ``leading``, its leading axis is split over ``axis_name`` (a batch);
  otherwise it is replicated over ``axis_name``. Other axes keep their
  sharding.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or jnp.ndim(x) == 0 and not leading:
    return x
  axes = set(axes_of(axis_name))
  entries = list(spec) + [None] * (jnp.ndim(x) - len(spec))
  kept = []
  for entry in entries:
    names = tuple(n for n in axes_of(entry) if n is not None and n not in axes)
    kept.append(None if not names else names[0] if len(names) == 1 else names)
  if leading:
    kept[0] = axis_name
  target = P(*kept)
  return x if tuple(target) == tuple(entries) else jax.sharding.reshard(
      x, target
  )


def over_mesh(
    data_parallel: Any,
    axis_name: AxisName,
    num_microbatches: int,
    params: Any,
    model_state: Any,
    batch: Any,
    args: Any,
) -> Any:
  """Runs ``data_parallel`` under shard_map over an axis of the current mesh.

  Under plain :func:`jax.jit` XLA would place the gradient all-reduce inside
  the micro-batch loop. Making the axis manual for the length of the loop
  keeps each device's sums local: every device splits its own shard of the
  batch into micro-batches (so every micro-batch spans all devices) and the
  sums are reduced once, after the loop.
  """
  size = mesh_axis_size(axis_name)
  if size is None:
    raise ValueError(
        f"axis_name={axis_name!r} is neither a manual axis here (inside"
        " jax.shard_map or jax.pmap) nor an axis of the current mesh; under"
        " jax.jit, set the mesh with jax.set_mesh(mesh). Current mesh:"
        f" {jax.sharding.get_abstract_mesh()}."
    )
  if any(jnp.ndim(x) == 0 for x in jax.tree.leaves(batch)):
    raise ValueError(
        "Every batch leaf needs a leading batch axis to shard over"
        f" {axis_name!r} and split into micro-batches; got a scalar."
    )
  batch_sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(batch)}
  for batch_size in batch_sizes:
    if batch_size % (size * num_microbatches):
      raise ValueError(
          f"The batch size {batch_size} must be divisible by num_microbatches"
          f" * size of axis {axis_name!r} = {num_microbatches} * {size}: each"
          " device splits its shard of the batch into micro-batches."
      )
  param_specs = jax.tree.map(lambda p: spec_over(p, axis_name), params)
  if _all_explicit(axis_name):
    batch = jax.tree.map(lambda x: _without_axes(x, axis_name, True), batch)
    model_state, args = jax.tree.map(
        lambda x: _without_axes(x, axis_name, False), (model_state, args)
    )

  def body(params, model_state, batch, args):
    loss, grads, model_state, aux = data_parallel(
        params, model_state, batch, args, param_specs
    )
    # One entry per device for each micro-batch: concatenated over devices.
    aux = jax.tree.map(lambda a: a[:, None] if a.ndim == 1 else a, aux)
    return loss, grads, model_state, aux

  sharded = jax.shard_map(
      body,
      in_specs=(param_specs, P(), P(axis_name), P()),
      out_specs=(P(), param_specs, P(), P(None, axis_name)),
      axis_names=set(axes_of(axis_name)),
  )
  return sharded(params, model_state, batch, tuple(args))
