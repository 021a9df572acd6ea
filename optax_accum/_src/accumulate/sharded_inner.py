"""ZeRO-1 read off ``inner``'s state: an optimizer already sharded over the
axes that the gradients are unreduced over, under jit.

An ``nnx.Optimizer`` whose Variables carry Flax's ``optimizer_sharding``
over axes that the parameters are replicated over lays ``inner``'s state out
in shards over them, with no argument of ours (as does ``opt.init`` on
resharded parameters in plain optax). Fed ``gradient_sync="deferred"``
gradients, unreduced over those axes, ``accumulate`` then runs as with
``shard_optimizer`` (:mod:`zero_sums`, ZeRO-1): the running sum is each
device's partial, whole, and the emitting branch reduce-scatters it straight
into the shards of ``inner``'s state (one reduce-scatter per sharded leaf
and update, no gradient-sized all-reduce); ``inner`` updates its shards and
the updates are gathered back to the parameters' layout
(``emit._laid_out_like``).

``tx.init`` lays the sums of such a tree out as every update call leaves
them (:func:`init_sums`): unreduced over the axes the Variables'
``optimizer_sharding`` names, so that the state's type is the same before
and after a call (one trace of the step). Flax would otherwise shard them
as the Variables say, and the first call would change their layout.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import flax_nnx
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import zero_sums
from optax_accum._src.mesh import readers


def _zero_axes(params: Any) -> frozenset[str]:
  """The Explicit mesh axes that some Variable's ``optimizer_sharding``
  shards the state over while its parameter is not sharded over them."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return frozenset()
  values = jax.tree.leaves(flax_nnx.unwrap_variables(params))
  named = {a for axes, value in zip(flax_nnx.optimizer_sharding_axes(params),
                                    values)
           for a in axes if a not in readers.spec_names(
               readers.plain_spec(value))}
  return frozenset(a for a in named if a in mesh.axis_names
                   and readers.are_explicit(mesh, (a,)))


def init_sums(grad_sum: Any, params: Any,
              shard_optimizer: tuple[str, ...] = ()) -> Any:
  """The first running sums: unreduced over ZeRO's axes where Variables of
  ``params`` carry an ``optimizer_sharding`` over them (with those of
  ``shard_optimizer``), else ``grad_sum``.

  Each leaf is handed back as a plain array, which ``nnx.Optimizer`` keeps
  as it is (a Variable would be resharded to its ``optimizer_sharding``). A
  leaf already sharded over the axes (ZeRO-2's) stays so.
  """
  data_axes = _zero_axes(params)
  if not data_axes:
    return grad_sum
  data_axes |= set(shard_optimizer)

  def unreduced(s):
    over = data_axes - set(readers.spec_names(readers.plain_spec(s)))
    if not over:
      return s
    return jax.sharding.reshard(
        s, P(*readers.partitions(readers.full_spec(s)), unreduced=over))

  return jax.tree.map(unreduced, flax_nnx.unwrap_variables(grad_sum))


def _shaped_like(tree: Any, structure: Any, shapes: list[Any]) -> bool:
  return (jax.tree.structure(tree) == structure
          and [jnp.shape(x) for x in jax.tree.leaves(tree)] == shapes)


def _shard_of(leaf: int, over: frozenset[str],
              like_sums: list[list[Any]]) -> P | None:
  """The spec of the first state leaf shaped like sum ``leaf`` that shards
  it over some of ``over``, the axes the sum is unreduced over."""
  for leaves in like_sums:
    spec = readers.plain_spec(leaves[leaf])
    if set(readers.spec_names(spec)) & over:
      return spec
  return None


def layout_of(inner_state: Any, updates: Any,
              grad_sum: Any) -> zero_sums.ZeroSums | None:
  """ZeRO-1 on ``inner_state``'s shards, where some state leaf shaped like
  the sums (adam's moments) shards one over axes its sum or gradient is
  unreduced over; None where none does."""
  overs = [readers.unreduced_axes(g) | readers.unreduced_axes(s)
           for g, s in zip(jax.tree.leaves(updates),
                           jax.tree.leaves(grad_sum))]
  if not any(overs):
    return None
  structure = jax.tree.structure(grad_sum)
  shapes = [jnp.shape(s) for s in jax.tree.leaves(grad_sum)]
  is_like = lambda t: _shaped_like(t, structure, shapes)
  like_sums = [jax.tree.leaves(t)
               for t in jax.tree.leaves(inner_state, is_leaf=is_like)
               if is_like(t)]
  shards = [_shard_of(i, over, like_sums) for i, over in enumerate(overs)]
  if all(spec is None for spec in shards):
    return None
  data_axes = tuple(sorted({a for spec, over in zip(shards, overs)
                            if spec is not None
                            for a in readers.spec_names(spec) if a in over}))
  specs = [readers.plain_spec(s) if spec is None else spec
           for s, spec in zip(jax.tree.leaves(grad_sum), shards)]
  return zero_sums.ZeroSums(
      data_axes, zero_sums.ONCE, typed_sums.TypedSums(),
      shards=jax.tree.unflatten(structure, specs))
