"""Collectives by sharding: gathering, scattering and summing shards.

The micro-batch loop gathers parameters sharded over the data axis (FSDP)
whole before the loop and scatters their gradients back into shards after
it (the specs read by :mod:`readers`); the deferred forms add and reduce
each device's partial sums (:func:`add_to_partials`,
:func:`reduce_scatter_unreduced`), the one reduction per update.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import compat
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


def gather(x: Any, spec: P) -> Any:
  """The whole array from this device's shard of it, laid out by ``spec``."""
  for dim, dim_axes in readers.sharded_dims(spec):
    x = lax.all_gather(x, readers.entry(dim_axes), axis=dim, tiled=True)
  return x


def psum(tree: Any, axis_name: readers.AxisName) -> Any:
  """:func:`jax.lax.psum` over ``axis_name``, in float32 at least, and safe
  on manual axes of size 1 (:func:`compat.psum_over_size1_axes`)."""
  names = readers.axes_of(axis_name)
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
  for dim, dim_axes in readers.sharded_dims(spec):
    leaf = compat.blockwise(
        lambda x, dim=dim, dim_axes=dim_axes: compat.summed_in_float32(
            lambda y: compat.psum_scatter(y, readers.entry(dim_axes), dim),
            x),
        leaf)
    used.update(dim_axes)
  return leaf, used


def sum_into_shards(
    tree: Any, specs: Any, extra: Any, axis_name: readers.AxisName,
    keep_unreduced: bool = False, scattered: bool = False,
) -> tuple[Any, Any]:
  """Sums ``tree`` over ``axis_name``, each leaf into its shard by ``specs``.

  A leaf whose spec shards it over the axis is reduce-scattered (each device
  keeps the sum of its own shard); the others, and ``extra``, are all-reduced
  together, in one collective. With ``keep_unreduced`` (deferred gradient
  sync) the leaves are only reduce-scattered over the axes that shard them
  and left unsummed over the rest: each device keeps its partial, to be
  typed unreduced over those axes; ``extra`` is still summed. With
  ``scattered`` the leaves are already their shards, each summed over the
  axes that shard it (``gradient_sync="every_microbatch"``): only the
  remaining axes are summed.

  Returns:
    ``(summed tree, summed extra)``.
  """
  leaves, treedef = jax.tree.flatten(tree)
  spec_leaves = treedef.flatten_up_to(specs)
  to_psum = []
  out = [None] * len(leaves)
  for i, (leaf, spec) in enumerate(zip(leaves, spec_leaves)):
    if scattered:
      used = set(readers.spec_names(spec))
    else:
      leaf, used = scatter(leaf, spec)
    if keep_unreduced:
      out[i] = leaf
      continue
    if not used:
      to_psum.append(i)
      continue
    rest = tuple(a for a in readers.axes_of(axis_name) if a not in used)
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
    names = tuple(sorted(set(readers.spec_names(spec))))
    by_axes.setdefault(names, []).append(leaf)
  total = jnp.zeros([], jnp.float32)
  for names, group in by_axes.items():
    part = sq_norm(group)
    total += lax.psum(part, names) if names else part
  return total


def add_to_partials(add: Callable[..., list[Any]], grads: list[Any],
                    sums: list[Any], weight: Any) -> list[Any]:
  """Workaround: ``add(grads, sums, weight)`` on each device's partials.

  ``add`` sees plain arrays, a device's partial of each unreduced leaf, and
  the (replicated) ``weight``, and returns the new sums: the typed loop's
  weighted add ``sum + weight * g``, which zeroes a micro-batch without
  tokens (its partial never looked at). JAX has no unreduced rule for a
  product of an unreduced array with a replicated scalar, nor for
  ``where`` (jax 0.9 refuses even a reduced scalar). Remove when JAX types
  both on unreduced arrays (it does ``div`` on its main branch after
  0.11.0): the add is then plain array arithmetic.
  """
  if not grads:
    return []
  return manual.on_own_partials(add, (grads, sums, weight),
                                 [readers.full_spec(s) for s in sums])


def reduce_scatter_unreduced(s: Any, target: P) -> Any:
  """An unreduced sum reduced to ``target``: reduce-scattered where it shards.

  ``s`` is typed unreduced over some mesh axes (each device's partial);
  ``target`` shards it over some of them, and is unreduced over, or
  replicated over, the others. Over the axes a dimension of ``target``
  names, each device's partial is summed and scattered in one
  ``lax.psum_scatter`` (a reduce-scatter: half the bytes of an all-reduce);
  over the remaining axes of ``s`` that ``target`` keeps unreduced nothing
  moves, and over the others it is a psum.

  Workaround: ``jax.sharding.reshard`` from the unreduced type to a sharded
  one compiles to a whole all-reduce and a slice on XLA's TPU backend (the
  GPU backend turns it into a reduce-scatter itself). Remove when XLA's TPU
  compiler forms reduce-scatters from that pattern
  (``tests/compiled/test_compiled_tpu.py`` checks the reduce-scatters either
  way).
  Falls back to the reshard where a dimension mixes the reduced axes with
  others (the order of its blocks would differ).
  """
  over = set(readers.full_spec(s).unreduced)
  entries = readers.partitions(target)
  if not over or any(
      set(readers.axes_of(e)) & over and not set(readers.axes_of(e)) <= over
      for e in entries if e is not None):
    return jax.sharding.reshard(s, target)
  kept = set(target.unreduced)
  summed = tuple(sorted(over - kept - {
      a for e in entries if e is not None for a in readers.axes_of(e)}))
  low = jnp.issubdtype(s.dtype, jnp.floating) and jnp.finfo(s.dtype).bits < 32

  def local(x):
    dtype = x.dtype
    x = x.astype(jnp.float32) if low else x
    for dim, entry in enumerate(entries):
      names = (tuple(a for a in readers.axes_of(entry) if a in over)
               if entry else ())
      if names:
        x = compat.psum_scatter(x, names, dim)
    if summed:
      x = lax.psum(x, summed)
    return x.astype(dtype)

  return manual.on_own_partials(local, (s,), target)
