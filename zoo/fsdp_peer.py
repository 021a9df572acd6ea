"""The loop a user would write for FSDP with the gradient reduced once.

The fair peer of ``oa.value_and_grad(..., gradient_sync="once")`` on an FSDP
mesh (SPEC 11): in a ``jax.shard_map``, each device gathers the parameters
once, holds the whole gradient's token-weighted sum of its micro-batches
through a ``lax.scan``, and reduce-scatters it into its shards after the loop
(replicated leaves: all-reduced). Used by ``tests/compiled/`` and benchmark
k's records; our own code.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo import typed_model as tm


def _sharded_dim(spec, axis):
  return next((i for i, a in enumerate(spec) if a == axis), None)


def scan_whole_sum(cfg: tm.Config, mesh, num_microbatches: int):
  """``f(params, batch) -> (loss, grads)`` on ``mesh``'s ``cfg.fsdp`` axis."""
  axis, specs = cfg.fsdp, tm.specs(cfg)
  loss_fn = tm.loss_fn(cfg._replace(batch_axes=(), fsdp=None))

  def weighted(params, microbatch):
    return loss_fn(params, microbatch) * tm.num_tokens(microbatch)

  def gather(p, spec):
    dim = _sharded_dim(spec, axis)
    return p if dim is None else lax.all_gather(p, axis, axis=dim, tiled=True)

  def reduce(g, spec):
    dim = _sharded_dim(spec, axis)
    if dim is None:
      return lax.psum(g, axis)
    return lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)

  def local(params, batch):
    full = jax.tree.map(gather, params, specs)
    split = jax.tree.map(
        lambda x: x.reshape((num_microbatches, -1) + x.shape[1:]), batch)

    def body(carry, microbatch):
      value, grads = jax.value_and_grad(weighted)(full, microbatch)
      return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, full))
    (value, grads), _ = lax.scan(body, zeros, split)
    tokens = lax.psum(tm.num_tokens(batch), axis)
    return (lax.psum(value, axis) / tokens,
            jax.tree.map(lambda g, s: reduce(g, s) / tokens, grads, specs))

  # check_vma off: the gathered parameters and the sums need no typing here.
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axis)),
                       out_specs=(P(), specs), check_vma=False)
