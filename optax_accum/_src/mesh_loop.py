"""The micro-batch loop under :func:`jax.jit` over a mesh axis.

Under plain :func:`jax.jit` XLA would place the gradient all-reduce inside the
micro-batch loop. Making the data axis manual for the length of the loop keeps
each device's sums local: every device splits its own shard of the batch into
micro-batches (so every micro-batch spans all devices) and the sums are
reduced once, after the loop.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import aux_reduction
from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import fsdp
from optax_accum._src import sharding
from optax_accum._src import unreduced_sums


def mesh_axis_size(axis_name: axes.AxisName) -> int:
  """The size of ``axis_name`` in the current mesh, or how to set the mesh."""
  size = axes.mesh_axis_size(axis_name)
  if size is None:
    raise ValueError(
        f"axis_name={axis_name!r} is neither a manual axis here (inside"
        " jax.shard_map or jax.pmap) nor an axis of the current mesh; under"
        " jax.jit, set the mesh with jax.set_mesh(mesh). Current mesh:"
        f" {jax.sharding.get_abstract_mesh()}."
    )
  return size


def _batch_spec(axis: int | None, axis_name: axes.AxisName) -> P:
  """A batch leaf's spec: split over the axis along ``axis``, or replicated.

  :func:`sharding.laid_out_over` lays a leaf out so.
  """
  return P() if axis is None else P(*([None] * axis), axis_name)


def over_mesh(
    data_parallel: Callable[..., Any],
    axis_name: axes.AxisName,
    num_microbatches: int,
    batch_axes: Any,
    params: Any,
    batch: Any,
    replicated: Any,
    param_specs: Any = None,
    unreduced_grads: bool = False,
) -> Any:
  """Runs ``data_parallel`` in a shard_map over an axis of the current mesh.

  Args:
    data_parallel: ``data_parallel(params, batch, replicated, param_specs)``
      returning ``(loss, grads, model_state, aux, stats)`` with ``aux`` an
      :class:`aux_reduction.Parts` and ``stats`` reduced over the axis (or
      None), run on each device's shard with ``axis_name`` manual.
    axis_name: the mesh axis (or axes) the batch is sharded over.
    num_microbatches: micro-batches per device.
    batch_axes: the split axis of each batch leaf (a prefix of ``batch``);
      a leaf with None is replicated over the axis, not split.
    params: the parameters; those sharded over the axis (Explicit) are
      passed to ``data_parallel`` as shards, with their specs.
    batch: the global batch, split over the axis along ``batch_axes``.
    replicated: everything else the loop reads (model state, args, kwargs,
      the PRNG key), replicated over the axis.
    param_specs: the parameters' specs (a spec or a tree prefix); None reads
      them off the parameters' types (Explicit axes).
    unreduced_grads: whether ``data_parallel`` leaves each device's partial
      gradient unsummed over the axes that do not shard its parameter
      (``gradient_sync="deferred"``): it comes back typed unreduced over
      them, e.g. ``P("fsdp", unreduced={"replica"})``.

  Returns:
    ``data_parallel``'s outputs; a stacked ``aux`` leaf is concatenated over
    devices along its first axis after the micro-batch axis, a reduced one
    is the same on every device.
  """
  size = mesh_axis_size(axis_name)
  leaf_axes = batching.leaf_axes(batch, batch_axes)
  batching.check_divisible(
      batching.split_size(batch, leaf_axes), num_microbatches, devices=size
  )
  leaves, treedef = jax.tree.flatten(batch)
  batch_specs = treedef.unflatten(
      [_batch_spec(a, axis_name) for a in leaf_axes])
  if param_specs is None:
    param_specs = jax.tree.map(
        lambda p: sharding.spec_over(p, axis_name), params)
  else:
    param_specs = fsdp.specs_like(params, param_specs, axis_name)
  if axes.all_explicit(axis_name):
    batch = treedef.unflatten([
        sharding.laid_out_over(x, axis_name, a)
        for x, a in zip(leaves, leaf_axes)
    ])
    replicated = jax.tree.map(
        lambda x: sharding.laid_out_over(x, axis_name, None), replicated)

  def body(params, batch, replicated):
    loss, grads, model_state, aux, stats = data_parallel(
        params, batch, replicated, param_specs
    )
    # One entry per device for each micro-batch: concatenated over devices.
    stacked = jax.tree.map(
        lambda a: a[:, None] if jnp.ndim(a) == 1 else a, aux.stacked)
    return loss, grads, model_state, aux._replace(stacked=stacked), stats

  grad_specs = param_specs
  if unreduced_grads:
    grad_specs = jax.tree.map(
        lambda s: P(*s, unreduced=set(
            unreduced_sums.slot_axes(s, axis_name))),
        param_specs, is_leaf=lambda x: isinstance(x, P))
  sharded = jax.shard_map(
      body,
      in_specs=(param_specs, batch_specs, P()),
      out_specs=(P(), grad_specs, P(),
                 aux_reduction.Parts(P(None, axis_name), P()), P()),
      axis_names=set(axes.axes_of(axis_name)),
  )
  return sharded(params, batch, replicated)
