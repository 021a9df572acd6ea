"""Workarounds for JAX and XLA: each one named, each with what retires it.

Every function here stands in for something JAX or XLA should do by itself
(or does, from some version on). Its docstring starts with "Workaround:"
and says when it can go: raising the minimum jax (``pyproject.toml``) or an
upstream fix then comes down to ``grep "Remove when"`` and deleting what
matches, its callers using the plain JAX operation instead.

Only retirable workarounds live here; it imports only the readers and the
one shard_map of :mod:`manual`, so that every other module may call it.
Shims that are core machinery (``collectives.reduce_scatter_unreduced``)
and those outside the mesh (``caller_warnings``, the planner's memory
refusal, the refusals in ``microbatch.forms`` and
``microbatch.reduced_fallbacks``) carry the same "Remove when" line.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.errors
from jax.experimental import layout as jax_layout
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


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


def while_loop_keeps_unreduced_sums() -> bool:
  """Workaround: whether a ``lax.while_loop`` of dynamic trip count may
  carry the typed loop's sums.

  Under jax 0.9.1, ``oa.value_and_grad`` with FSDP over one of two data
  axes and ``gradient_sync="every_microbatch"`` (each shard's sum still
  unreduced over the other axis) came out wrong from such a loop and
  exact from a ``lax.scan``; jax 0.10.2 is exact from both (checked by
  ``tests/forms/test_fsdp.py`` in both CI environments). Versions between
  were not tried. Remove when jax >= 0.10.2 is the minimum.
  """
  return tuple(int(p) for p in jax.__version__.split(".")[:3]
               if p.isdigit()) >= (0, 10, 2)


def full(shape: tuple[int, ...], value: Any, dtype: Any,
         spec: P | None) -> jax.Array:
  """Workaround: ``jnp.full(shape, value, dtype, out_sharding=spec)``.

  ``jnp.full`` takes ``out_sharding`` from jax 0.10.2 on; zeros plus the
  value type the same. Remove when jax >= 0.10.2 is the minimum.
  """
  zeros = jnp.zeros(shape, dtype, out_sharding=spec)
  return zeros + jnp.asarray(value, dtype)


def blockwise(collective: Callable[[Any], Any], x: Any) -> Any:
  """Workaround: ``collective(x)`` on ``x``'s blocks over other mesh axes.

  JAX cannot type some collectives over manual (data) axes of
  an operand sharded over other, Explicit mesh axes (``psum_scatter`` in
  jax 0.10: tensor parallelism inside the loop's shard_map); making those
  axes manual for the collective alone moves no data along them. Remove
  when jax types ``lax.psum_scatter`` of such an operand (see
  ``tests/unit/mesh/test_collectives.py``, which fails without it).
  """
  found = readers.sharded_by_explicit_axes(x)
  if found is None:
    return collective(x)
  spec, names = found
  return manual.shard_map(collective, in_specs=spec, out_specs=spec,
                          axis_names=names)(x)


def summed_in_float32(collective: Callable[[Any], Any], tree: Any) -> Any:
  """Workaround: ``collective(tree)``, a sum taken in float32 at least.

  XLA aborts the process (``Invalid binary instruction opcode
  copy``) compiling a bfloat16 all-reduce or reduce-scatter in a shard_map
  that leaves other mesh axes automatic (a data x model mesh). Leaves
  narrower than float32 are widened for the collective and narrowed after
  it (which also rounds once, not at every device). Remove when XLA's CPU
  and GPU backends compile a bfloat16 all-reduce in a partially manual
  program (``tests/support/bf16_mesh_worker.py`` checks it).
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


def psum_scatter(x: Any, axis_name: Any, dim: int) -> Any:
  """Workaround: ``lax.psum_scatter(x, axis_name, scatter_dimension=dim,
  tiled=True)`` that XLA's TPU compiler keeps a reduce-scatter.

  Its ``reduce-scatter-decomposer`` (after layout assignment) turns a
  reduce-scatter into a whole all-reduce and a slice unless the scattered
  dimension is the second-minor of the result's layout, the sublane one.
  Layout assignment often picks another: a 4-D sum carried out of the
  micro-batch loop (qkv's ``f32[d, 3, heads, head_dim]``) gets its row-major
  layout, and a 2-D view of it the transposed one. On TPU the result's
  layout is pinned here (the scattered dimension second-minor, the last
  other one minor); elsewhere nothing changes (the GPU backend keeps the
  reduce-scatter, the CPU one all-reduces either way). Remove when XLA's TPU
  compiler lays a reduce-scatter out for itself
  (``tests/compiled/test_compiled_tpu.py`` counts the reduce-scatters).
  """
  y = lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
  if y.ndim < 2 or readers.mesh_platform() != "tpu":
    return y
  rest = [i for i in range(y.ndim) if i != dim]
  return jax_layout.with_layout_constraint(
      y, jax_layout.Layout(major_to_minor=(*rest[:-1], dim, rest[-1])))


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


def cast_unreduced(x: Any, spec: P) -> Any:
  """Workaround: a value the same on every device, typed ``spec``.

  ``spec`` is unreduced over some axes. The partitions are set first; then
  each device's partial: the value on the first device of the unreduced
  axes, zeros on the others, so that the sum over them is the value. One
  ``jax.sharding.reshard`` that changes both the partitions and the
  unreduced axes aborts XLA, and jax 0.9's reshard to unreduced kept the
  value on every device (its sum then counts it once per device). Remove
  when jax >= 0.10 is the minimum and XLA compiles such a reshard (then
  ``jax.sharding.reshard(x, spec)``; ``cast_checks.check_casts``
  keeps the two casts that XLA still gets wrong out of the loop).
  """
  if readers.partitions(readers.full_spec(x)) != readers.partitions(spec):
    x = jax.sharding.reshard(x, P(*readers.partitions(spec)))
  over = tuple(sorted(spec.unreduced))
  return manual.on_own_partials(
      lambda v: manual.on_first_device(v, over), (x,), spec)

