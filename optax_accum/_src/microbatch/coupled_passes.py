"""The two passes of gradient caching and the loss between them.

The first pass encodes every micro-batch without keeping activations; the
loss and its gradients are taken on the whole batch's representations; the
second pass runs each micro-batch forward again and pulls its rows of the
representations' gradient back through the encoder with :func:`jax.vjp`.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching


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
    if jnp.ndim(out[0]) != 0:
      raise ValueError("loss_fn must return a scalar loss, got shape"
                       f" {jnp.shape(out[0])}.")
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
