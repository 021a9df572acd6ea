"""Sharding surgery: reading specs off types, gathering and scattering shards.

Under :func:`jax.jit` with Explicit mesh axes an array's type carries its
sharding. The micro-batch loop reads it to learn which parameters are sharded
over the data axis (FSDP), gathers them whole before the loop and scatters
their gradients back into shards after it.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from optax_accum._src import axes
from optax_accum._src import compat


def explicit_spec(x: Any) -> P | None:
  """The spec of ``x``'s type if it is sharded over Explicit mesh axes."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  names = [n for e in spec if e is not None for n in axes.axes_of(e)]
  mesh = sharding.mesh
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if names and all(types.get(n) == AxisType.Explicit for n in names):
    return spec
  return None


def partitions(spec: P) -> tuple[Any, ...]:
  """A spec's entries, without its reduced/unreduced sets.

  ``*spec`` is refused once a spec has unreduced or reduced axes.
  """
  return tuple(getattr(spec, "partitions", None)
               or getattr(spec, "_partitions", ()))


def full_spec(x: Any) -> P:
  """``x``'s whole spec read off its type, reduced and unreduced sets
  included (``P()`` without one)."""
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  return P() if spec is None else spec


def entry(names: tuple[str, ...]) -> Any:
  """A spec entry for ``names``: None, one name, or a tuple of names."""
  return None if not names else names[0] if len(names) == 1 else names


def restrict(spec: P, axis_name: axes.AxisName) -> P:
  """The part of ``spec`` over ``axis_name``; other mesh axes are dropped."""
  wanted = set(axes.axes_of(axis_name))
  entries = [
      entry(tuple(n for n in axes.axes_of(e) if n is not None and n in wanted))
      for e in spec
  ]
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def spec_over(x: Any, axis_name: axes.AxisName) -> P:
  """The part of ``x``'s sharding that is over ``axis_name``, as a spec.

  Only explicitly sharded arrays (``AxisType.Explicit`` meshes) carry their
  sharding in their type; other arrays give ``P()``.
  """
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  return P() if spec is None else restrict(spec, axis_name)


def sharded_dims(spec: P) -> list[tuple[int, tuple[str, ...]]]:
  """``(dimension, its mesh axes)`` for every sharded dimension of ``spec``."""
  return [(d, axes.axes_of(e)) for d, e in enumerate(spec) if e is not None]


def gather(x: Any, spec: P) -> Any:
  """The whole array from this device's shard of it, laid out by ``spec``."""
  for dim, dim_axes in sharded_dims(spec):
    x = lax.all_gather(x, entry(dim_axes), axis=dim, tiled=True)
  return x


# partial_sums (accumulate's reduction) still reads it here.
summed_in_float32 = compat.summed_in_float32


def psum(tree: Any, axis_name: axes.AxisName) -> Any:
  """:func:`jax.lax.psum` over ``axis_name``, in float32 at least, and safe
  on manual axes of size 1 (:func:`compat.psum_over_size1_axes`)."""
  names = axes.axes_of(axis_name)
  trivial = tuple(a for a in names if lax.axis_size(a) == 1)
  active = tuple(a for a in names if a not in trivial)
  if active:
    tree = compat.summed_in_float32(lambda t: lax.psum(t, active), tree)
  if trivial:
    tree = compat.psum_over_size1_axes(tree, trivial)
  return tree


def scatter(leaf: Any, spec: P) -> tuple[Any, set[str]]:
  """Reduce-scatters ``leaf`` into its shard; returns it and the axes used."""
  used = set()
  for dim, dim_axes in sharded_dims(spec):
    leaf = compat.blockwise(
        lambda x, dim=dim, dim_axes=dim_axes: compat.summed_in_float32(
            lambda y: lax.psum_scatter(
                y, entry(dim_axes), scatter_dimension=dim, tiled=True), x),
        leaf)
    used.update(dim_axes)
  return leaf, used


def sum_into_shards(
    tree: Any, specs: Any, extra: Any, axis_name: axes.AxisName,
    keep_unreduced: bool = False,
) -> tuple[Any, Any]:
  """Sums ``tree`` over ``axis_name``, each leaf into its shard by ``specs``.

  A leaf whose spec shards it over the axis is reduce-scattered (each device
  keeps the sum of its own shard); the others, and ``extra``, are all-reduced
  together, in one collective. With ``keep_unreduced`` (deferred gradient
  sync) the leaves are only reduce-scattered over the axes that shard them
  and left unsummed over the rest: each device keeps its partial, to be
  typed unreduced over those axes; ``extra`` is still summed.

  Returns:
    ``(summed tree, summed extra)``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  to_psum = []
  out = [None] * len(leaves)
  for i, (leaf, spec) in enumerate(zip(leaves, spec_leaves)):
    leaf, used = scatter(leaf, spec)
    if keep_unreduced:
      out[i] = leaf
      continue
    if not used:
      to_psum.append(i)
      continue
    rest = tuple(a for a in axes.axes_of(axis_name) if a not in used)
    out[i] = psum(leaf, rest) if rest else leaf
  summed, extra = psum(([leaves[i] for i in to_psum], extra), axis_name)
  for i, leaf in zip(to_psum, summed):
    out[i] = leaf
  return treedef.unflatten(out), extra


def sq_norm_of_shards(tree: Any, specs: Any, sq_norm: Any) -> jax.Array:
  """The squared norm of a tree whose leaves are shards laid out by ``specs``.

  Replicated leaves count once; sharded ones are summed over their axes, one
  scalar reduction for each distinct set of axes.
  """
  leaves, treedef = jax.tree.flatten(tree)
  by_axes: dict[tuple[str, ...], list[Any]] = {}
  for leaf, spec in zip(leaves, treedef.flatten_up_to(specs)):
    names = tuple(sorted({a for _, d in sharded_dims(spec) for a in d}))
    by_axes.setdefault(names, []).append(leaf)
  total = jnp.zeros([], jnp.float32)
  for names, group in by_axes.items():
    part = sq_norm(group)
    total += lax.psum(part, names) if names else part
  return total
