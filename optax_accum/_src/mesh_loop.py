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

from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import sharding


def _mesh_axis_size(axis_name: axes.AxisName) -> int:
  size = axes.mesh_axis_size(axis_name)
  if size is None:
    raise ValueError(
        f"axis_name={axis_name!r} is neither a manual axis here (inside"
        " jax.shard_map or jax.pmap) nor an axis of the current mesh; under"
        " jax.jit, set the mesh with jax.set_mesh(mesh). Current mesh:"
        f" {jax.sharding.get_abstract_mesh()}."
    )
  return size


def over_mesh(
    data_parallel: Callable[..., Any],
    axis_name: axes.AxisName,
    num_microbatches: int,
    params: Any,
    model_state: Any,
    batch: Any,
    args: Any,
) -> Any:
  """Runs ``data_parallel`` in a shard_map over an axis of the current mesh.

  Args:
    data_parallel: ``data_parallel(params, model_state, batch, args,
      param_specs)`` returning ``(loss, grads, model_state, aux)``, run on each
      device's shard with ``axis_name`` manual.
    axis_name: the mesh axis (or axes) the batch is sharded over.
    num_microbatches: micro-batches per device.
    params: the parameters; those sharded over the axis (Explicit) are
      passed to ``data_parallel`` as shards, with their specs.
    model_state: threaded model state or None, replicated over the axis.
    batch: the global batch, split over the axis along its leading axis.
    args: further arguments, replicated over the axis.

  Returns:
    ``data_parallel``'s outputs; an ``aux`` leaf is concatenated over devices
    along its first axis after the micro-batch axis.
  """
  size = _mesh_axis_size(axis_name)
  batching.check_divisible(
      batching.batch_size(batch), num_microbatches, devices=size
  )
  param_specs = jax.tree.map(lambda p: sharding.spec_over(p, axis_name), params)
  if axes.all_explicit(axis_name):
    batch = jax.tree.map(
        lambda x: sharding.without_axes(x, axis_name, True), batch
    )
    model_state, args = jax.tree.map(
        lambda x: sharding.without_axes(x, axis_name, False),
        (model_state, args),
    )

  def body(params, model_state, batch, args):
    loss, grads, model_state, aux = data_parallel(
        params, model_state, batch, args, param_specs
    )
    # One entry per device for each micro-batch: concatenated over devices.
    aux = jax.tree.map(lambda a: a[:, None] if jnp.ndim(a) == 1 else a, aux)
    return loss, grads, model_state, aux

  sharded = jax.shard_map(
      body,
      in_specs=(param_specs, P(), P(axis_name), P()),
      out_specs=(P(), param_specs, P(), P(None, axis_name)),
      axis_names=set(axes.axes_of(axis_name)),
  )
  return sharded(params, model_state, batch, tuple(args))
