"""ZeRO layouts: the optimizer's shards over the data axes, one per leaf.

ZeRO-1 keeps the parameters as the model lays them out (replicated over the
data axes) and shards the optimizer's state over the data axes; ZeRO-2 shards
the gradient's running sum too. Both need, for each leaf, the spec of its
shard: :func:`zero_specs` gives it, from the leaf's shape and its own spec
alone, so that a parameter, its gradient, its running sum and the optimizer
state leaves shaped like it all get the same spec, wherever they are laid
out. The first dimension that no mesh axis shards and that the data axes'
size divides is sharded over the data axes; a leaf without one (a scalar, a
bias of odd length, a vocabulary that does not divide) keeps its spec: it
stays replicated over the data axes, whole on every device, and exact.
"""

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from optax_accum._src import validation
from optax_accum._src.mesh import readers


def _mesh(mesh: Any) -> Any:
  validation.check_mesh(mesh)
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh is None or not mesh.axis_names:
    raise ValueError(
        "oa.zero_specs needs a mesh: call it under jax.set_mesh(mesh), or"
        " pass mesh=mesh.")
  return mesh


def check_data_axes(axis_name: Any, mesh: Any) -> tuple[str, ...]:
  """``axis_name`` as a tuple of the mesh's axes, or our error."""
  if axis_name is None:
    raise ValueError(
        "axis_name must name the data axes to shard the optimizer over (e.g."
        " 'data' or ('data', 'fsdp')), got None.")
  names = readers.axes_of(axis_name)
  unknown = readers.missing_axes(names, mesh)
  if unknown or not names:
    raise ValueError(
        f"axis_name={axis_name!r} names {unknown or 'no'} mesh axes; the mesh"
        f" has {tuple(readers.axis_sizes(mesh))}.")
  return names


def leaf_spec(shape: tuple[int, ...], own: P, data_axes: tuple[str, ...],
              sizes: dict[str, int]) -> P:
  """One leaf's ZeRO spec: ``own`` with the data axes on one dimension."""
  entries = readers.padded_entries(own, len(shape))
  data_size = math.prod(sizes[a] for a in data_axes)
  if not set(readers.spec_names(own)) & set(data_axes):  # else FSDP's own.
    for dim, (size, e) in enumerate(zip(shape, entries)):
      if e is None and size % data_size == 0 and size >= data_size:
        entries[dim] = readers.entry(data_axes)
        break
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def zero_specs(tree: Any, axis_name: readers.AxisName, *,
               mesh: Any = None) -> Any:
  """The spec of each leaf's ZeRO shard: its own, plus the data axes.

  For ZeRO-1 and ZeRO-2 (the optimizer's state, and the gradient's running
  sum for ZeRO-2, sharded over the data axes while the parameters stay
  replicated there): each leaf of ``tree`` (parameters, gradients, an optax
  state; arrays or :class:`jax.ShapeDtypeStruct`) gets its own spec (its
  type's, under Explicit mesh axes: tensor-parallel axes are kept) with
  ``axis_name`` placed on its first dimension that no mesh axis shards and
  that the data axes' size divides. A leaf without such a dimension (a
  scalar, an odd-sized bias or vocabulary) keeps its spec: replicated over
  the data axes, whole on each device, and its gradient is all-reduced.
  The spec depends on a leaf's shape and own spec only, so an optimizer
  state's leaves shaped like a parameter get the parameter's.

  Args:
    tree: a pytree of arrays (or anything with ``shape``).
    axis_name: the data axes (a mesh axis name or a tuple of them).
    mesh: the mesh; by default the one set with :func:`jax.set_mesh`.

  Returns:
    A pytree like ``tree`` of :class:`jax.sharding.PartitionSpec`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Explicit,))
    >>> params = {'w': jnp.zeros((16, 4)), 'b': jnp.zeros(3)}
    >>> specs = oa.zero_specs(params, 'data', mesh=mesh)
    >>> {name: tuple(spec) for name, spec in specs.items()}
    {'b': (), 'w': ('data',)}
  """
  mesh = _mesh(mesh)
  data_axes = check_data_axes(axis_name, mesh)
  sizes = readers.axis_sizes(mesh)
  return jax.tree.map(
      lambda x: leaf_spec(tuple(jax.numpy.shape(x)),
                          readers.explicit_spec(x) or P(), data_axes, sizes),
      tree)

