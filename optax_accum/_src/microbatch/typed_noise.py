"""The typed form's noise-scale sums: each device's rows as a small batch.

With ``with_stats=True`` the gradient noise scale needs small-batch squared
norms (docs/noise_scale.md). In the typed form each device's partial of a
reduced leaf is the gradient of its own rows of the micro-batch: a small
batch of its own, weighted by its rows' tokens. Its squared norm is taken
on the device (inside a shard_map over every mesh axis), so that only
scalars cross devices.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers
from optax_accum._src.rules import noise_scale


def _sq_norm_of_blocks(blocks: list[Any], specs: list[P],
                       data: frozenset[str]) -> jax.Array:
  """Inside a shard_map over every mesh axis: this device's share of the
  squared norm of its partials (its blocks of each leaf, counted once over
  the model axes that do not shard the leaf)."""
  total = jnp.zeros([], jnp.float32)
  for block, spec in zip(blocks, specs):
    sharded = set(readers.spec_names(spec))
    copies = 1
    for name in jax.sharding.get_abstract_mesh().axis_names:
      if name not in sharded and name not in data:
        copies *= lax.axis_size(name)
    total += jnp.sum(jnp.square(block.astype(jnp.float32))) / copies
  return total


def device_tokens(count_tokens, microbatch, tokens: jax.Array,
                axis_name: readers.AxisName) -> jax.Array:
  """Each device's share of the micro-batch's tokens, one per device
  (sharded over the data axes): ``count_tokens`` of its rows, scaled so
  that they add up to ``tokens`` (the same for an additive count, such
  as a mask's sum; an equal share for a constant one)."""
  data = readers.axes_of(axis_name)
  specs = jax.tree.map(
      lambda x: readers.restrict(readers.full_spec(x), axis_name),
      microbatch)

  def count(mb):
    n = jnp.asarray(count_tokens(mb), jnp.float32).reshape(1)
    return axes.device_local(n, axis_name)

  counts = manual.shard_map(count, in_specs=(specs,),
                         out_specs=P(readers.entry(data)),
                         axis_names=set(data))(microbatch)
  total = jnp.sum(counts)
  return counts * jnp.where(total > 0, tokens / jnp.where(
      total > 0, total, 1.0), 0.0)

def add_device_rows(sums, partials, c, loss_reduction, count_tokens,
                  microbatch, axis_name: readers.AxisName):
  """``sum_d n_d |g_d|^2`` over the devices ``d`` with tokens, ``g_d``
  the per-token mean gradient of device ``d``'s rows: its partial ``p_d``
  is ``(n_d / n) g_d`` (``"mean"``) or ``n_d g_d`` (``"sum"``)."""
  shares = device_tokens(count_tokens, microbatch, c.tokens, axis_name)
  data = frozenset(readers.axes_of(axis_name))
  specs = [readers.full_spec(p) for p in partials]
  names = tuple(jax.sharding.get_abstract_mesh().axis_names)

  def local(partials, share, c):
    n_d = share[0]
    has = c.keep & (n_d > 0)
    safe = jnp.where(has, n_d, 1.0)
    sq = _sq_norm_of_blocks(partials, specs, data)
    if loss_reduction == "mean":
      n = jnp.where(has, c.tokens, 0.0)
      term = n * n / safe * sq
    else:
      term = sq / safe
    term = jnp.where(has, term, 0.0)
    # Each device of the data axes counts its rows once: its copies over
    # the model axes count 1 / copies each.
    copies = 1
    for name in names:
      if name not in data:
        copies *= lax.axis_size(name)
    return lax.psum((term, has.astype(jnp.float32) / copies), names)

  term, counted = manual.shard_map(
      local, in_specs=(specs, readers.full_spec(shares), P()),
      out_specs=P(), axis_names=set(names), check_vma=False,
  )(partials, shares, c)
  return noise_scale.StatsSums(sums.weighted_sq_norms + term,
                               sums.num_microbatches + counted)
