"""Reading shardings off types: specs, mesh axes and their sizes.

Under :func:`jax.jit` with Explicit mesh axes an array's type carries its
sharding (``float32[8,4]@(data,)``), and a gradient's type may say it is
*unreduced* over some axes (``{U:data}``: each device holds a partial). Every
other module reads those facts through the functions here, so that one
module changes when JAX renames an attribute. This module sits at the bottom
of the package: it imports nothing of ours.
"""

import math
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

AxisName = str | tuple[str, ...]


def axes_of(axis_name: AxisName) -> tuple[str, ...]:
  """The mesh axes of an axis name or spec entry, as a tuple."""
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def mesh_platform(tree: Any = None) -> str | None:
  """The platform the current mesh compiles for (``"tpu"``, ``"cpu"``...);
  without one set, that of the mesh in the first typed leaf of ``tree``;
  else None."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      getattr(getattr(_aval(x), "sharding", None), "mesh", None)
      for x in jax.tree.leaves(tree)]
  for mesh in meshes:
    device = getattr(mesh, "abstract_device", None)
    if getattr(device, "platform", None) is not None:
      return device.platform
    kind = str(getattr(device, "device_kind", "") or "").lower()
    if kind:  # jax < 0.10 names no platform: its device kind tells.
      return "cpu" if kind == "cpu" else "tpu" if "tpu" in kind else "gpu"
  return None


def entry(names: tuple[str, ...]) -> Any:
  """A spec entry for ``names``: None, one name, or a tuple of names."""
  return None if not names else names[0] if len(names) == 1 else names


def _aval(x: Any) -> Any:
  """The type of a value; a ShapeDtypeStruct or an aval is its own."""
  if isinstance(x, jax.ShapeDtypeStruct) or (
      not isinstance(x, jax.Array) and hasattr(x, "sharding")):
    return x
  return jax.typeof(x)


def full_spec(x: Any) -> P:
  """``x``'s whole spec read off its type, reduced and unreduced sets
  included (``P()`` without one)."""
  spec = getattr(getattr(_aval(x), "sharding", None), "spec", None)
  return P() if spec is None else spec


def partitions(spec: P) -> tuple[Any, ...]:
  """A spec's entries, without its reduced/unreduced sets.

  ``*spec`` is refused once a spec has unreduced or reduced axes. jax 0.9
  keeps them in the private ``_partitions`` only: remove that fallback when
  jax >= 0.10.2 is the minimum (``PartitionSpec.partitions`` there).
  """
  return tuple(getattr(spec, "partitions", None)
               or getattr(spec, "_partitions", ()))


def placed_spec(x: Any) -> P | None:
  """The spec of ``x``'s own sharding: a concrete array's as placed (Auto
  axes included, which its type does not carry), an aval's as typed."""
  return getattr(getattr(x, "sharding", None), "spec", None)


def plain_spec(x: Any) -> P:
  """``x``'s spec without its reduced and unreduced sets."""
  return P(*partitions(full_spec(x)))


def unreduced_axes(x: Any) -> frozenset[str]:
  """The mesh axes over which ``x``'s type says it is unreduced."""
  return frozenset(getattr(full_spec(x), "unreduced", ()))


def axis_types(mesh: Any) -> dict[str, Any]:
  """Each axis of ``mesh`` and its :class:`jax.sharding.AxisType`."""
  return dict(zip(mesh.axis_names, mesh.axis_types))


def axis_sizes(mesh: Any) -> dict[str, int]:
  """Each axis of ``mesh`` and its size."""
  return dict(mesh.shape)


def missing_axes(names: tuple[str, ...], mesh: Any) -> list[str]:
  """The axes of ``names`` that ``mesh`` lacks, in order."""
  sizes = axis_sizes(mesh)
  return [n for n in names if n not in sizes]


def are_explicit(mesh: Any, names: tuple[str, ...]) -> bool:
  """Whether every axis of ``names`` is Explicit in ``mesh``."""
  types = axis_types(mesh)
  return all(types.get(n) == AxisType.Explicit for n in names)


def spec_names(spec: P) -> tuple[str, ...]:
  """Every mesh axis a spec's entries name, in order."""
  return tuple(n for e in partitions(spec) if e is not None
               for n in axes_of(e))


def explicit_spec(x: Any) -> P | None:
  """The spec of ``x``'s type if it is sharded over Explicit mesh axes."""
  sharding = getattr(_aval(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  names = spec_names(spec)
  if names and are_explicit(sharding.mesh, names):
    return spec
  return None


def sharded_by_explicit_axes(x: Any) -> tuple[P, set[str]] | None:
  """``x``'s spec and the Explicit, not manual, mesh axes that shard it."""
  spec = explicit_spec(x)
  if spec is None:
    return None
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  names = set(spec_names(spec)) - manual
  return (spec, names) if names else None


def restrict(spec: P, axis_name: AxisName) -> P:
  """The part of ``spec`` over ``axis_name``; other mesh axes are dropped."""
  wanted = set(axes_of(axis_name))
  entries = [
      entry(tuple(n for n in axes_of(e) if n is not None and n in wanted))
      for e in spec
  ]
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def spec_over(x: Any, axis_name: AxisName) -> P:
  """The part of ``x``'s sharding that is over ``axis_name``, as a spec.

  Only explicitly sharded arrays (``AxisType.Explicit`` meshes) carry their
  sharding in their type; other arrays give ``P()``.
  """
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return P() if spec is None else restrict(spec, axis_name)


def sharded_dims(spec: P) -> list[tuple[int, tuple[str, ...]]]:
  """``(dimension, its mesh axes)`` for every sharded dimension of ``spec``."""
  return [(d, axes_of(e)) for d, e in enumerate(spec) if e is not None]


def summed_like(grads: Any) -> Any:
  """``grads`` once reduced: their shapes, typed without ``unreduced``."""
  return jax.tree.map(
      lambda g: jax.ShapeDtypeStruct(
          jax.numpy.shape(g), jax.numpy.result_type(g), sharding=plain_spec(g)),
      grads,
  )


def mesh_axis_size(axis_name: AxisName) -> int | None:
  """The size of ``axis_name`` in the current mesh, if all its axes are there.

  Manual axes (inside :func:`jax.shard_map`) do not count: there each device
  holds one slot.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  sizes = axis_sizes(mesh)
  manual = set(getattr(mesh, "manual_axes", ()))
  names = axes_of(axis_name)
  if any(a not in sizes or a in manual for a in names):
    return None
  return math.prod(sizes[a] for a in names)


def all_explicit(axis_name: AxisName) -> bool:
  """Whether every axis of ``axis_name`` is Explicit in the current mesh."""
  return are_explicit(jax.sharding.get_abstract_mesh(), axes_of(axis_name))


def padded_entries(spec: P, ndim: int) -> list[Any]:
  """``spec``'s entries, one per dimension of an ``ndim``-array."""
  entries = list(partitions(spec))
  return entries + [None] * (ndim - len(entries))


def data_axes_in(spec: P, axis_name: AxisName) -> tuple[str, ...]:
  """The data axes that shard a dimension of ``spec``, in mesh order."""
  used = set(spec_names(spec))
  return tuple(a for a in axes_of(axis_name) if a in used)


def drop_axes(spec: P, names: tuple[str, ...], ndim: int) -> list[Any]:
  """``spec``'s entries with the mesh axes ``names`` dropped."""
  return [
      None if e is None else entry(
          tuple(n for n in axes_of(e) if n not in names))
      for e in padded_entries(spec, ndim)
  ]


def merged_spec(type_spec: P, data_spec: P | None, axis_name: AxisName,
                ndim: int) -> P:
  """A parameter's spec: its type's, over data axes as ``data_spec`` says.

  ``data_spec`` (``param_specs=``, restricted to the data axes) replaces the
  type's entries over data axes; None keeps them.
  """
  if data_spec is None:
    return P(*padded_entries(type_spec, ndim))
  kept = drop_axes(type_spec, axes_of(axis_name), ndim)
  given = padded_entries(data_spec, ndim)
  return P(*[
      entry(tuple(axes_of(g) if g is not None else ())
                     + tuple(axes_of(k) if k is not None else ()))
      for k, g in zip(kept, given)
  ])


def mesh_of(x: Any) -> Any:
  """The abstract mesh ``x``'s type is sharded over, or None."""
  mesh = getattr(getattr(_aval(x), "sharding", None), "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return getattr(mesh, "abstract_mesh", mesh)


def auto_axes(mesh: Any) -> dict[str, int]:
  """The Auto axes of ``mesh`` of size > 1, with their sizes (axes made
  manual here are typed Manual, not Auto)."""
  if mesh is None or mesh.empty:
    return {}
  types = axis_types(mesh)
  return {n: s for n, s in axis_sizes(mesh).items()
          if types[n] == AxisType.Auto and s > 1}
