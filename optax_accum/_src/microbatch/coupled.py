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
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import layout
from optax_accum._src.microbatch import loss_signature
from optax_accum._src.microbatch import rng as rng_lib
from optax_accum._src.microbatch import runner
from optax_accum._src.rules import aux_reduction

# The two passes and the loss between them.


class LossOnReps(NamedTuple):
  """The loss on the whole batch's representations and its gradients."""

  loss: jax.Array  # shape=(), the dtype loss_fn returns.
  aux: Any  # what loss_fn returns next to the loss, or None.
  direct: Any  # d loss / d params with the representations held fixed.
  cotangents: list[jax.Array]  # d loss / d reps, one per floating reps leaf.


def _is_differentiable(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def floating_leaves(reps: Any) -> list[jax.Array]:
  """The leaves of ``reps`` that have a gradient (integer labels have none)."""
  return [x for x in jax.tree.leaves(reps) if _is_differentiable(x)]


def _check_reps(reps: Any, rows: int) -> None:
  """Raises unless every leaf of ``reps`` has one row per example."""
  leaves = jax.tree_util.tree_leaves_with_path(reps)
  if not leaves:
    raise ValueError("encode_fn must return at least one array, got an empty"
                     f" tree: {reps!r}.")
  for path, leaf in leaves:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != rows:
      raise ValueError(
          f"encode_fn's output reps{jax.tree_util.keystr(path)} has shape"
          f" {shape}; every representation needs the micro-batch's leading"
          f" axis of size {rows} (one row per example), so that the micro-"
          "batches' representations concatenate into the batch's."
      )


def _encode(encode_fn, params, microbatch, args, key):
  if key is None:
    return encode_fn(params, microbatch, *args)
  return encode_fn(params, microbatch, *args, rng=key)


def _indices(batch_split: batching.Split) -> jax.Array:
  return jnp.arange(batch_split.leaves[0].shape[
      next(a for a in batch_split.axes if a is not None)])


def encode_all(encode_fn, params, batch_split: batching.Split, keys, args):
  """The first pass: every micro-batch's representations, no activations.

  They come back in the batch's row order.
  """

  def step(_, xs):
    index, key = xs
    microbatch = batching.take(batch_split, index)
    reps = _encode(encode_fn, params, microbatch, args, key)
    _check_reps(reps, batch_split.rows)
    return None, reps

  _, reps = lax.scan(step, None, (_indices(batch_split), keys))
  return jax.tree.map(
      lambda r: batching.merge_rows(r, batch_split), reps)


def loss_on_reps(loss_fn, has_aux, params, reps, batch, args) -> LossOnReps:
  """The loss of the whole batch and its gradients at fixed ``reps``."""
  leaves, treedef = jax.tree.flatten(reps)
  floating = [i for i, x in enumerate(leaves) if _is_differentiable(x)]

  def loss_of(p, float_reps):
    merged = list(leaves)
    for i, leaf in zip(floating, float_reps):
      merged[i] = leaf
    out = loss_fn(p, treedef.unflatten(merged), batch, *args)
    if has_aux:
      if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError("loss_fn must return a pair (loss, aux) with"
                         f" has_aux=True, got {type(out).__name__}.")
    else:
      out = (out, None)
    loss_signature.scalar(out[0])
    return out

  (loss, aux), (direct, cotangents) = jax.value_and_grad(
      loss_of, argnums=(0, 1), has_aux=True
  )(params, [leaves[i] for i in floating])
  return LossOnReps(loss, aux, direct, cotangents)


def _add(grad_sum, grads):
  """``grad_sum + grads``; unreduced sums are added on each device's own
  partials (:func:`collectives.add_to_partials`): jax 0.9.1 gave D times the
  gradient of a parameter used twice in ``encode_fn`` with a plain add."""
  sums, treedef = jax.tree.flatten(grad_sum)
  new = [g.astype(s.dtype) for s, g in zip(sums, jax.tree.leaves(grads))]
  if not any(readers.unreduced_axes(s) for s in sums):
    return treedef.unflatten([s + g for s, g in zip(sums, new)])
  return treedef.unflatten(collectives.add_to_partials(
      lambda g, s, w: [a + b for a, b in zip(s, g)], new, sums,
      jnp.float32(1.0)))


def pull_back(encode_fn, params, batch_split: batching.Split, keys,
              cotangents, init, args):
  """The second pass: adds each micro-batch's J^T cotangent to ``init``.

  ``cotangents`` are per micro-batch: ``(k, rows, ...)`` leaves.
  """

  def step(grad_sum, xs):
    index, key, cotangent = xs
    microbatch = batching.take(batch_split, index)
    _, vjp = jax.vjp(
        lambda p: floating_leaves(
            _encode(encode_fn, p, microbatch, args, key)
        ),
        params,
    )
    (grads,) = vjp(cotangent)
    return _add(grad_sum, grads), None

  grad_sum, _ = lax.scan(
      step, init, (_indices(batch_split), keys, cotangents))
  return grad_sum


# The entry point.


def _microbatch_keys(rng: Any, num_microbatches: int,
                     axis_name: readers.AxisName | None) -> Any:
  """The keys of :func:`rng_lib.key_for`, one per micro-batch."""
  if rng is None:
    return None
  return jax.vmap(lambda i: rng_lib.key_for(rng, i, axis_name))(
      jnp.arange(num_microbatches)
  )


class _Coupled(NamedTuple):
  """The settings of one coupled_value_and_grad."""

  encode_fn: Callable[..., Any]
  loss_fn: Callable[..., Any]
  num_microbatches: int
  has_aux: bool
  accumulator_dtype: Any
  batch_axes: Any


def _local(c: _Coupled, params, inputs, lay: layout.Layout) -> layout.Partials:
  """Loss, aux and the gradient sum, before the one reduction.

  With data axes made manual (``lay.num_devices > 1``) the loss is the mean
  of the devices' losses on the gathered representations, so each device's
  share (loss, direct gradient, representation cotangent) is divided by the
  number of devices; the reduce-scatter sums the cotangents of each
  device's rows.
  """
  k = c.num_microbatches
  batch_split = lay.split(inputs.batch, k)
  keys = _microbatch_keys(inputs.rng, k, lay.device_axis)
  reps = encode_all(
      c.encode_fn, params, batch_split, keys, inputs.args)
  own_rows = floating_leaves(reps)
  reps, batch = lay.gather_rows(reps, inputs.batch)
  out = loss_on_reps(
      c.loss_fn, c.has_aux, lay.loss_params(params), reps, batch, inputs.args
  )
  cotangents = lay.scatter_rows(out.cotangents, own_rows)
  devices = lay.num_devices
  if devices > 1:
    cotangents = [t / devices for t in cotangents]
    direct = jax.tree.map(lambda g: g / devices, out.direct)
  else:
    direct = out.direct
  cotangents = [batching.split_rows(t, batch_split) for t in cotangents]
  init = lay.as_sums(jax.tree.map(
      lambda g, d: g.astype(d), direct,
      validation.per_leaf_dtypes(c.accumulator_dtype, direct)))
  grad_sum = pull_back(
      c.encode_fn, params, batch_split, keys, cotangents, init, inputs.args
  )
  loss = out.loss / devices if devices > 1 else out.loss
  return layout.Partials(grads=grad_sum, sums=loss,
                         maxima=[], minima=[], means=None, rest=out.aux)


def _finalize(partials: layout.Partials, params,
              lay: layout.Layout) -> layout.Result:
  del lay  # no statistics here.
  grads = jax.tree.map(
      lambda s, p: s.astype(jnp.result_type(p)), partials.grads, params)
  return layout.Result(
      loss=partials.sums, grads=grads, model_state=None,
      aux=aux_reduction.Parts(partials.rest, None), stats=None)


def coupled_value_and_grad(
    encode_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    *,
    num_microbatches: int,
    has_aux: bool = False,
    axis_name: readers.AxisName | None = None,
    accumulator_dtype: Any = None,
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
    accumulator_dtype: floating dtype of the gradient's running sum; None
      (the default): the wider of float32 and each parameter's dtype.
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
      None if accumulator_dtype is None
      else validation.check_accumulator_dtype(accumulator_dtype),
      batching.check_batch_axes(batch_axes),
  )
  program = layout.Program(
      local=functools.partial(_local, coupled), finalize=_finalize,
      aux_axis=0, new_aux_axis=True)
  settings = runner.Settings(
      validation.check_axis_name(axis_name), num_microbatches,
      coupled.batch_axes, fsdp.check_param_specs(param_specs), fsdp.Policy())

  @functools.wraps(loss_fn)
  def fn(params, batch, *args, rng=None):
    loss_signature.check_params(params)
    inputs = loss_signature.Inputs(
        None, batch, args, {}, rng_lib.check_rng(rng))
    result = runner.run(program, settings, params, inputs)
    aux = result.aux.stacked
    return ((result.loss, aux), result.grads) if coupled.has_aux else (
        result.loss, result.grads)

  return fn
