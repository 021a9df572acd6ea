"""The loops a user would write by hand: the typed form's fair peers.

SPEC 11 compares ``oa.value_and_grad``'s compiled programs with these, on
the decoder of ``typed_model``: :func:`token_weighted_scan`, a
``lax.scan`` of ``jax.grad`` whose carry adds ``n_i g_i`` (or, for benchmark
k's loop patterns, a bf16 cast, a clip or a NaN guard of it), and, for
``gradient_sync="once"`` on an FSDP mesh, :func:`scan_whole_sum`: in a
``jax.shard_map``, each device gathers the parameters once, holds the whole
gradient's token-weighted sum of its micro-batches through a ``lax.scan``,
and reduce-scatters it into its shards after the loop (replicated leaves:
all-reduced). Used by ``tests/compiled/`` and benchmark k; our own code.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zoo import typed_model as tm


def _microbatches(batch, k, data_axes, devices):
  """``(k, rows / k, ...)``: block i of every device's rows, no data moved."""
  def cut(x):
    rows = x.shape[0] // (devices * k)
    x = x.reshape((devices, k, rows) + x.shape[1:],
                  out_sharding=P(data_axes))
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((k, devices * rows) + x.shape[3:],
                     out_sharding=P(None, data_axes))
  return jax.tree.map(cut, batch)


def token_weighted_scan(loss_fn, k, data_axes, devices, pattern="plain scan",
                        out_specs=None):
  """A token-weighted ``lax.scan`` of ``jax.grad``, its carry per pattern;
  the gradient resharded to ``out_specs`` (ZeRO-1: ``oa.zero_specs``) after
  the loop, if given."""
  def weighted(params, microbatch):
    return loss_fn(params, microbatch) * tm.num_tokens(microbatch)

  def add(carry, g):
    if pattern == "bf16 grad into f32 carry":
      return carry + g.astype(jnp.bfloat16)
    if pattern == "clipped carry":
      return jnp.clip(carry + g, -1e4, 1e4)
    if pattern == "NaN-guarded carry":
      return jnp.where(jnp.all(jnp.isfinite(g)), carry + g, carry)
    return carry + g

  def step(params, batch):
    def body(carry, microbatch):
      value, grads = jax.value_and_grad(weighted)(params, microbatch)
      return (carry[0] + value, jax.tree.map(add, carry[1], grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (value, grads), _ = lax.scan(
        body, zeros, _microbatches(batch, k, data_axes, devices))
    tokens = jnp.maximum(tm.num_tokens(batch), 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    if out_specs is not None:
      grads = jax.tree.map(jax.sharding.reshard, grads, out_specs)
    return value / tokens, grads

  return step


def _sharded_dim(spec, axis):
  return next((i for i, a in enumerate(spec) if a == axis), None)


def scan_whole_sum(cfg: tm.Config, mesh, num_microbatches: int):
  """``f(params, batch) -> (loss, grads)`` on ``mesh``'s ``cfg.fsdp`` axis:
  the parameters gathered once, the whole gradient's sum held through the
  loop and reduce-scattered after it (``gradient_sync="once"``)."""
  return _fsdp_scan(cfg, mesh, num_microbatches, scatter_in_loop=False)


def scan_scattered_sum(cfg: tm.Config, mesh, num_microbatches: int):
  """The same gathered once, each micro-batch's gradient reduce-scattered
  in the loop into a sum sharded like the parameters (the loop a user writes
  for ``gather_params="once"``, ``gradient_sync="every_microbatch"``). An
  optimization barrier keeps the reduce-scatters in the loop, as the policy
  does: XLA's TPU compiler moves ``sum += reduce_scatter(g)`` out of it."""
  return _fsdp_scan(cfg, mesh, num_microbatches, scatter_in_loop=True)


def _fsdp_scan(cfg, mesh, num_microbatches, scatter_in_loop):
  axis, specs = cfg.fsdp, tm.specs(cfg)
  loss_fn = tm.loss_fn(cfg._replace(batch_axes=(), fsdp=None))

  def weighted(params, microbatch):
    return loss_fn(params, microbatch) * tm.num_tokens(microbatch)

  def gather(p, spec):
    dim = _sharded_dim(spec, axis)
    return p if dim is None else lax.all_gather(p, axis, axis=dim, tiled=True)

  def scatter(g, spec):  # a psum where the leaf is not sharded.
    dim = _sharded_dim(spec, axis)
    if dim is None:
      return lax.psum(g, axis)
    return lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)

  def in_loop(g, spec):
    return g if _sharded_dim(spec, axis) is None else scatter(g, spec)

  def after_loop(g, spec):
    return scatter(g, spec) if not scatter_in_loop or _sharded_dim(
        spec, axis) is None else g

  def local(params, batch):
    full = jax.tree.map(gather, params, specs)
    split = jax.tree.map(
        lambda x: x.reshape((num_microbatches, -1) + x.shape[1:]), batch)

    def body(carry, microbatch):
      value, grads = jax.value_and_grad(weighted)(full, microbatch)
      if scatter_in_loop:
        grads = lax.optimization_barrier(jax.tree.map(in_loop, grads, specs))
      return (carry[0] + value, jax.tree.map(jnp.add, carry[1], grads)), None

    sums = params if scatter_in_loop else full
    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, sums))
    (value, grads), _ = lax.scan(body, zeros, split)
    tokens = lax.psum(tm.num_tokens(batch), axis)
    return (lax.psum(value, axis) / tokens,
            jax.tree.map(lambda g, s: after_loop(g, s) / tokens, grads, specs))

  # check_vma off: the gathered parameters and the sums need no typing here.
  return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axis)),
                       out_specs=(P(), specs), check_vma=False)
