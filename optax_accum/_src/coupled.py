r"""Gradient caching: exact gradients of losses that couple a batch's examples.

A contrastive loss with in-batch negatives, a loss divided by a batch-wide
normaliser or a global load-balancing term is not a sum over examples: micro-
batch ``i``'s gradient depends on every other example, so no weighting of
micro-batch gradients gives the full batch's. Gradient caching (Gao et al.,
2021) splits the model into an encoder and a loss on the whole batch's
representations and computes the exact gradient in two passes over
micro-batches, holding one micro-batch's activations at a time.
"""

from collections.abc import Callable
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from optax_accum._src import aux_reduction
from optax_accum._src import axes
from optax_accum._src import batching
from optax_accum._src import compat
from optax_accum._src import coupled_passes
from optax_accum._src import fsdp
from optax_accum._src import loss_signature
from optax_accum._src import microbatch_rng
from optax_accum._src import runner
from optax_accum._src import sharding
from optax_accum._src import stages
from optax_accum._src import typed_layout
from optax_accum._src import validation


def _microbatch_keys(rng: Any, num_microbatches: int,
                     axis_name: axes.AxisName | None) -> Any:
  """The keys of :func:`microbatch_rng.key_for`, one per micro-batch."""
  if rng is None:
    return None
  return jax.vmap(lambda i: microbatch_rng.key_for(rng, i, axis_name))(
      jnp.arange(num_microbatches)
  )


def _axis_size(axis_name: axes.AxisName) -> int:
  return math.prod(lax.axis_size(a) for a in axes.axes_of(axis_name))


def _over_rows(collective: Callable[[jax.Array], jax.Array],
               leaves: list[jax.Array]) -> list[jax.Array]:
  """Applies a collective over rows to ``leaves``: one call per dtype.

  Leaves of a dtype are flattened to ``(rows, features)`` and concatenated
  along the features, so that two towers' representations (or their
  cotangents) travel in one all-gather (or reduce-scatter), not one each.
  Leaves sharded over other Explicit mesh axes (tensor parallelism) travel
  one by one, on their local blocks (:func:`compat.blockwise`).
  """
  if any(sharding.explicit_spec(x) is not None for x in leaves):
    return [compat.blockwise(collective, x) for x in leaves]
  groups = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(jnp.result_type(leaf), []).append(i)
  out = [None] * len(leaves)
  for members in groups.values():
    flat = [jnp.reshape(leaves[i], (jnp.shape(leaves[i])[0], -1))
            for i in members]
    packed = collective(jnp.concatenate(flat, axis=1))
    ends = np.cumsum([f.shape[1] for f in flat])[:-1]
    for i, part in zip(members, jnp.split(packed, ends, axis=1)):
      out[i] = part.reshape(packed.shape[:1] + jnp.shape(leaves[i])[1:])
  return out


class _Coupled(NamedTuple):
  """The settings of one coupled_value_and_grad."""

  encode_fn: Callable[..., Any]
  loss_fn: Callable[..., Any]
  num_microbatches: int
  has_aux: bool
  accumulator_dtype: Any
  batch_axes: Any


def _local(c: _Coupled, params, inputs, lay) -> stages.Partials:
  """Loss, aux and this device's gradient sum, before any reduction.

  With a data axis the loss is the mean of the devices' losses on the
  gathered representations, so each device's share (loss, direct gradient,
  representation cotangent) is divided by the number of devices; the
  reduce-scatter sums the cotangents of each device's rows.
  """
  # Under a typed layout the loop sees global values: nothing to gather.
  axis_name = lay.axis_name if isinstance(lay, fsdp.Layout) else None
  k = c.num_microbatches
  batch_split = batching.split(inputs.batch, c.batch_axes, k,
                               sharded_layout_for_auto=lay is None)
  keys = _microbatch_keys(inputs.rng, k, axis_name)
  reps = coupled_passes.encode_all(
      c.encode_fn, params, batch_split, keys, inputs.args)
  devices = 1
  batch, loss_params, sharded_like = inputs.batch, params, None
  if axis_name is not None:
    devices = _axis_size(axis_name)
    leaves, treedef = jax.tree.flatten(reps)
    reps = treedef.unflatten(_over_rows(
        lambda x: lax.all_gather(x, axis_name, axis=0, tiled=True), leaves
    ))
  elif isinstance(lay, typed_layout.Layout):
    # The loss sees the whole batch's representations on every device, as
    # under shard_map; its direct gradient is the replicated parameters'.
    sharded_like = coupled_passes.floating_leaves(reps)
    reps, batch = typed_layout.gathered(lay, (reps, batch))
    loss_params = typed_layout.replicated(lay, params)
  out = coupled_passes.loss_on_reps(
      c.loss_fn, c.has_aux, loss_params, reps, batch, inputs.args
  )
  cotangents = out.cotangents
  if sharded_like is not None:
    cotangents = [jax.sharding.reshard(t, sharding.full_spec(r))
                  for t, r in zip(cotangents, sharded_like)]
  if axis_name is not None:
    cotangents = _over_rows(
        lambda x: compat.summed_in_float32(lambda y: lax.psum_scatter(
            y, axis_name, scatter_dimension=0, tiled=True), x),
        cotangents,
    )
  if devices > 1:
    cotangents = [t / devices for t in cotangents]
    direct = jax.tree.map(lambda g: g / devices, out.direct)
  else:
    direct = out.direct
  cotangents = [batching.split_rows(t, batch_split) for t in cotangents]
  init = jax.tree.map(lambda g: g.astype(c.accumulator_dtype), direct)
  if axis_name is not None:
    init = axes.device_local(init, axis_name)
  elif isinstance(lay, typed_layout.Layout):
    init = typed_layout.as_sums(lay, init)
  grad_sum = coupled_passes.pull_back(
      c.encode_fn, params, batch_split, keys, cotangents, init, inputs.args
  )
  loss = out.loss / devices if devices > 1 else out.loss
  return stages.Partials(grads=grad_sum, sums=loss,
                         maxima=[], minima=[], means=None, rest=out.aux)


def _finalize(partials: stages.Partials, params, sq_norm) -> stages.Result:
  del sq_norm  # no statistics here.
  grads = jax.tree.map(
      lambda s, p: s.astype(jnp.result_type(p)), partials.grads, params)
  return stages.Result(
      loss=partials.sums, grads=grads, model_state=None,
      aux=aux_reduction.Parts(partials.rest, None), stats=None)


def coupled_value_and_grad(
    encode_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int,
    has_aux: bool = False,
    axis_name: axes.AxisName | None = None,
    accumulator_dtype: Any = jnp.float32,
    batch_axes: Any = 0,
    param_specs: Any = None,
) -> Callable[..., Any]:
  r"""Value and gradient of a loss coupling a batch, by micro-batches.

  For ``L(params) = loss_fn(params, encode_fn(params, batch), batch)`` where
  ``loss_fn`` couples the examples (in-batch negatives, a batch-wide
  normaliser, a global load-balancing term), returns exactly (to float
  rounding) ``jax.value_and_grad(L)(params)`` while holding the activations of
  one micro-batch at a time, plus the whole batch's representations ``R``.
  With ``R_i = encode_fn(params, microbatch_i)``, the chain rule gives

  .. math::
    \nabla L = \frac{\partial L}{\partial \theta}\Big|_R
      + \sum_i J_{R_i}(\theta)^\top \frac{\partial L}{\partial R_i},

  computed in three steps: a first :func:`jax.lax.scan` encodes every
  micro-batch without keeping activations; the loss, its direct gradient and
  its gradient with respect to ``R`` are taken on the whole batch; a second
  scan runs each micro-batch forward again and pulls its slice of
  :math:`\partial L / \partial R` back with :func:`jax.vjp`, adding it to a
  sum kept in ``accumulator_dtype``. It costs one extra forward pass.

  Representations may be any pytree whose leaves have one row per example
  (two towers, embeddings and router logits, or integer labels that the loss
  needs; leaves that are not floating get no gradient). With ``rng=`` each
  micro-batch gets its own key, as in :func:`optax_accum.value_and_grad`
  (``fold_in(rng, i)``, the device's index folded in first under
  ``axis_name``), the same in both passes so that dropout masks agree; it is
  passed to ``encode_fn`` as ``rng=``.

  With ``axis_name`` (data parallelism, as in
  :func:`optax_accum.value_and_grad`: a manual axis inside
  :func:`jax.shard_map` or :func:`jax.pmap`, or an axis of the mesh set by
  :func:`jax.set_mesh` under :func:`jax.jit`), each device encodes its shard
  of the batch, the representations are all-gathered over the axis once, and
  ``loss_fn`` gets the global batch's representations (in device order) with
  this device's shard of ``batch``. The loss is taken as the mean of the
  devices' losses (the same on every device when ``loss_fn`` reads only the
  representations): one reduce-scatter gives each device the cotangent of its
  own rows, and the gradient is summed over devices once, after the loop. No
  collective runs inside either loop. Parameters sharded over the axis (FSDP)
  are gathered once and their gradients reduce-scattered, as in
  :func:`optax_accum.value_and_grad`. Under :func:`jax.jit` with a mesh,
  ``aux`` comes back with a new leading axis, one entry per device.

  Args:
    encode_fn: ``encode_fn(params, microbatch, *args)`` (and ``rng=`` when
      given) returning the representations of the micro-batch's examples: a
      pytree whose leaves have the micro-batch's leading axis.
    loss_fn: ``loss_fn(params, reps, batch, *args)`` returning a scalar loss,
      or ``(loss, aux)`` with ``has_aux``; ``reps`` are the whole batch's.
    num_microbatches: how many micro-batches to split the batch into.
    has_aux: whether ``loss_fn`` returns auxiliary data.
    axis_name: data-parallel axis (or axes): a manual axis or a mesh axis.
    accumulator_dtype: floating dtype of the gradient's running sum.
    batch_axes: the axis of each batch leaf to split into micro-batches, as
      for :func:`optax_accum.value_and_grad`; ``encode_fn``'s
      representations keep one row per example along their leading axis,
      in the batch's order.
    param_specs: how the parameters are sharded over ``axis_name``, as for
      :func:`optax_accum.value_and_grad` (None: read off their types).

  Returns:
    ``fn(params, batch, *args, rng=None)`` returning ``(loss, grads)``, or
    ``((loss, aux), grads)`` with ``has_aux``; ``grads`` in the parameters'
    dtypes, the loss in the dtype ``loss_fn`` returns.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax_accum as oa
    >>> encode = lambda w, x: x @ w
    >>> def loss(w, reps, x):  # normalised by the whole batch: not a sum
    ...   return jnp.sum(reps ** 2) / jnp.sum(jnp.abs(reps))
    >>> w, x = jnp.ones((2, 3)), jnp.arange(8.0).reshape(4, 2)
    >>> fn = oa.coupled_value_and_grad(encode, loss, num_microbatches=2)
    >>> value, grads = fn(w, x)
    >>> value
    Array(9.857142, dtype=float32)
    >>> full = jax.value_and_grad(lambda w: loss(w, encode(w, x), x))(w)
    >>> bool(jnp.allclose(value, full[0]) and jnp.allclose(grads, full[1]))
    True

  References:
    Gao et al, `Scaling Deep Contrastive Learning Batch Size under Memory
    Limited Setup <https://arxiv.org/abs/2101.06983>`_, 2021
  """
  for name, f in (("encode_fn", encode_fn), ("loss_fn", loss_fn)):
    if not callable(f):
      raise TypeError(f"{name} must be callable, got {f!r}.")
  num_microbatches = validation.check_positive_int(
      "num_microbatches", num_microbatches
  )
  coupled = _Coupled(
      encode_fn, loss_fn, num_microbatches,
      validation.check_bool("has_aux", has_aux),
      validation.check_accumulator_dtype(accumulator_dtype),
      batching.check_batch_axes(batch_axes),
  )
  program = stages.Program(
      local=functools.partial(_local, coupled), finalize=_finalize,
      aux_axis=0, new_aux_axis=True, coupled=True)
  settings = runner.Settings(
      validation.check_axis_name(axis_name), num_microbatches,
      coupled.batch_axes, fsdp.check_param_specs(param_specs), fsdp.Policy())

  @functools.wraps(loss_fn)
  def fn(params, batch, *args, rng=None):
    inputs = loss_signature.Inputs(
        None, batch, args, {}, microbatch_rng.check(rng))
    result = runner.run(program, settings, params, inputs)
    aux = result.aux.stacked
    return ((result.loss, aux), result.grads) if coupled.has_aux else (
        result.loss, result.grads)

  return fn
