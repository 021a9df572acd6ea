"""Workarounds for JAX and XLA: each one named, each with what retires it.

Every function here stands in for something JAX or XLA should do by itself
(or does, from some version on). Its docstring starts with "Workaround:"
and says when it can go: raising the minimum jax (``pyproject.toml``) or an
upstream fix then comes down to ``grep "Remove when"`` and deleting what
matches, its callers using the plain JAX operation instead.

This module sits at the bottom of the package: it imports nothing of ours,
so that every module (:mod:`axes` and :mod:`sharding` first) can call it.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.errors
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def varying_axes_of(aval: Any) -> frozenset[str]:
  """Workaround: the manual axes a value of type ``aval`` may vary over.

  jax 0.9 keeps them in ``aval.vma``, jax 0.10 in
  ``aval.manual_axis_type.varying``. Remove when jax >= 0.10.2 is the
  minimum (read the second only).
  """
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
  return frozenset(vma)


def sharding_type_error() -> type[Exception]:
  """Workaround: the class of JAX's refusals of sharding types.

  JAX raises it for a ``reduced`` operand with one sharded over the same
  axes, and the like. jax 0.9 and 0.10 raise ``ShardingTypeError`` from a
  private module, and it derives from neither ``TypeError`` nor
  :class:`jax.errors.JAXTypeError`. Remove when :mod:`jax.errors` exports
  it (then name it there).
  """
  public = getattr(jax.errors, "ShardingTypeError", None)
  if public is not None:
    return public
  from jax._src import core  # pylint: disable=g-import-not-at-top
  return core.ShardingTypeError


def full(shape: tuple[int, ...], value: Any, dtype: Any,
         spec: P | None) -> jax.Array:
  """Workaround: ``jnp.full(shape, value, dtype, out_sharding=spec)``.

  ``jnp.full`` takes ``out_sharding`` from jax 0.10.2 on; zeros plus the
  value type the same. Remove when jax >= 0.10.2 is the minimum.
  """
  zeros = jnp.zeros(shape, dtype, out_sharding=spec)
  return zeros + jnp.asarray(value, dtype)


def _names(entry: Any) -> tuple[str, ...]:
  return entry if isinstance(entry, tuple) else (entry,)


def _spec(x: Any) -> P:
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  spec = getattr(getattr(aval, "sharding", None), "spec", None)
  return P() if spec is None else spec


def _partitions(spec: P) -> tuple[Any, ...]:
  return tuple(getattr(spec, "partitions", None)
               or getattr(spec, "_partitions", ()))


def _other_explicit_axes(x: Any) -> tuple[P, set[str]] | None:
  """``x``'s spec and the Explicit, not manual, mesh axes that shard it."""
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  mesh = sharding.mesh
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  names = {n for e in spec if e is not None for n in _names(e)}
  if not names or any(types.get(n) != AxisType.Explicit for n in names):
    return None
  manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
  names -= manual
  return (spec, names) if names else None


def blockwise(collective: Callable[[Any], Any], x: Any) -> Any:
  """Workaround: ``collective(x)`` on ``x``'s blocks over other mesh axes.

  JAX cannot type some collectives over manual (data) axes of
  an operand sharded over other, Explicit mesh axes (``psum_scatter`` in
  jax 0.10: tensor parallelism inside the loop's shard_map); making those
  axes manual for the collective alone moves no data along them. Remove
  when jax types ``lax.psum_scatter`` of such an operand (see
  ``tests/test_sharding.py``, which fails without it).
  """
  found = _other_explicit_axes(x)
  if found is None:
    return collective(x)
  spec, names = found
  return jax.shard_map(collective, in_specs=spec, out_specs=spec,
                       axis_names=names)(x)


def summed_in_float32(collective: Callable[[Any], Any], tree: Any) -> Any:
  """Workaround: ``collective(tree)``, a sum taken in float32 at least.

  XLA aborts the process (``Invalid binary instruction opcode
  copy``) compiling a bfloat16 all-reduce or reduce-scatter in a shard_map
  that leaves other mesh axes automatic (a data x model mesh). Leaves
  narrower than float32 are widened for the collective and narrowed after
  it (which also rounds once, not at every device). Remove when XLA's CPU
  and GPU backends compile a bfloat16 all-reduce in a partially manual
  program (``tests/bf16_mesh_worker.py`` checks it).
  """
  leaves, treedef = jax.tree.flatten(tree)
  narrow = [jnp.issubdtype(jnp.result_type(x), jnp.floating)
            and jnp.finfo(x.dtype).bits < 32 for x in leaves]
  if not any(narrow):
    return collective(tree)
  wide = [x.astype(jnp.float32) if n else x for x, n in zip(leaves, narrow)]
  out = jax.tree.leaves(collective(treedef.unflatten(wide)))
  return treedef.unflatten([y.astype(x.dtype) if n else y
                            for x, y, n in zip(leaves, out, narrow)])


def psum_over_size1_axes(tree: Any, names: tuple[str, ...]) -> Any:
  """Workaround: :func:`jax.lax.psum` over manual axes of size 1, by leaf.

  In a partially manual program XLA cannot partition an
  all-reduce over a manual axis of size 1 whose operand is sharded over
  another, Explicit axis (``RET_CHECK failure ... Cross-partition allreduce
  must be in (partial) manual partitioning mode``). The sum moves no data,
  but its type says the value is the same on every device of the axis: it
  is taken on the local blocks (:func:`blockwise`), which XLA compiles.
  Remove when XLA partitions such an all-reduce (then ``lax.psum`` over
  every axis at once).
  """
  return jax.tree.map(lambda x: blockwise(lambda y: summed_in_float32(
      lambda z: lax.psum(z, names), y), x), tree)


def on_own_partials(fn: Callable[..., Any], args: tuple[Any, ...],
                     out_specs: Any) -> Any:
  """``fn(*args)`` on each device's own blocks: every mesh axis manual.

  Each argument leaf is split as its type says: an unreduced leaf arrives
  as the device's partial, a plain array. JAX takes unreduced specs only
  with every axis manual, and its type checker sees a partial as neither
  invariant nor varying (``check_vma=False``).

  Workaround: JAX has no unreduced rules for most arithmetic (a product
  with a replicated scalar, ``where``, ``isfinite``, ``div``), so it is
  written on each device's blocks. Remove with its callers' workarounds,
  when those rules exist.
  """
  return jax.shard_map(
      fn, in_specs=jax.tree.map(_spec, args), out_specs=out_specs,
      axis_names=set(jax.sharding.get_abstract_mesh().axis_names),
      check_vma=False,
  )(*args)


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
  return on_own_partials(add, (grads, sums, weight),
                          [_spec(s) for s in sums])


def cast_unreduced(x: Any, spec: P) -> Any:
  """Workaround: a value the same on every device, typed ``spec``.

  ``spec`` is unreduced over some axes. The partitions are set first; then
  each device's partial: the value on the first device of the unreduced
  axes, zeros on the others, so that the sum over them is the value. One
  ``jax.sharding.reshard`` that changes both the partitions and the
  unreduced axes aborts XLA, and jax 0.9's reshard to unreduced kept the
  value on every device (its sum then counts it once per device). Remove
  when jax >= 0.10 is the minimum and XLA compiles such a reshard (then
  ``jax.sharding.reshard(x, spec)``; ``reduced_fallbacks.check_casts``
  keeps the two casts that XLA still gets wrong out of the loop).
  """
  plain = P(*_partitions(spec))
  if _partitions(_spec(x)) != _partitions(spec):
    x = jax.sharding.reshard(x, plain)
  over = tuple(sorted(spec.unreduced))

  def partial(v):
    first = lax.axis_index(over) == 0
    return jnp.where(first, v, jnp.zeros_like(v))

  return on_own_partials(partial, (x,), spec)


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
  (``tests/test_compiled_tpu.py`` checks the reduce-scatters either way).
  Falls back to the reshard where a dimension mixes the reduced axes with
  others (the order of its blocks would differ).
  """
  over = set(_spec(s).unreduced)
  entries = _partitions(target)
  if not over or any(
      set(_names(e)) & over and not set(_names(e)) <= over
      for e in entries if e is not None):
    return jax.sharding.reshard(s, target)
  kept = set(target.unreduced)
  summed = tuple(sorted(over - kept - {
      a for e in entries if e is not None for a in _names(e)}))
  low = jnp.issubdtype(s.dtype, jnp.floating) and jnp.finfo(s.dtype).bits < 32

  def local(x):
    dtype = x.dtype
    x = x.astype(jnp.float32) if low else x
    for dim, entry in enumerate(entries):
      names = tuple(a for a in _names(entry) if a in over) if entry else ()
      if names:
        x = lax.psum_scatter(x, names, scatter_dimension=dim, tiled=True)
    if summed:
      x = lax.psum(x, summed)
    return x.astype(dtype)

  return on_own_partials(local, (s,), target)
