r"""Reducing ``aux`` over micro-batches, as the loop runs, and over devices.

A per-token metric (accuracy, a per-token loss) computed on each micro-batch
is a mean over that micro-batch's tokens; the plain mean of those means is not
the full batch's. ``"mean"`` weighs micro-batch ``i``'s value by its token
count ``n_i``, the rule of :mod:`token_weighting`:

.. math::
  \bar a = \frac{\sum_i n_i a_i}{\sum_i n_i},

so that it comes back as the full batch's metric (a micro-batch without
tokens adds nothing; a batch without tokens gives 0, not NaN). ``"sum"``,
``"max"`` and ``"min"`` take every micro-batch as it is; ``"stack"`` keeps one
entry per micro-batch. The reductions run in the loop's carry, so memory does
not grow with the number of micro-batches; under a data-parallel axis they
run over the devices once, after the loop (the sums within the one reduction
of the gradient).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._src import tree_match
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.rules import token_weighting

REDUCTIONS = ("stack", "mean", "sum", "max", "min")


class Running(NamedTuple):
  """The running reductions: one entry per ``aux`` leaf, None where unused."""

  sums: list[Any]  # "mean" (token-weighted) and "sum" leaves.
  extrema: list[Any]  # "max" and "min" leaves.


class Parts(NamedTuple):
  """``aux`` by how it was reduced: two trees, None in each other's place."""

  stacked: Any  # leading axis: one entry per micro-batch.
  reduced: Any  # reduced over micro-batches (and devices).


def check_aux_reduction(aux_reduction: Any, has_aux: bool) -> Any:
  """Returns ``aux_reduction`` if every leaf is one of :data:`REDUCTIONS`."""
  leaves = jax.tree.leaves(aux_reduction)
  for leaf in leaves or [aux_reduction]:
    if not isinstance(leaf, str) or leaf not in REDUCTIONS:
      raise ValueError(
          f"aux_reduction must be one of {REDUCTIONS}, or a pytree prefix of"
          f" aux with those as leaves, got {leaf!r} in {aux_reduction!r}."
      )
  if not has_aux and any(leaf != "stack" for leaf in leaves):
    raise ValueError(
        f"aux_reduction={aux_reduction!r} reduces aux, but has_aux=False:"
        " set has_aux=True and return (loss, aux) from loss_fn."
    )
  return aux_reduction


def is_running(aux_reduction: Any) -> bool:
  """Whether any leaf is reduced in the loop (not only stacked)."""
  return any(leaf != "stack" for leaf in jax.tree.leaves(aux_reduction))


def aux_rules_per_leaf(aux_reduction: Any, aux: Any) -> list[str]:
  """The reduction of each leaf of ``aux``, in order."""
  return tree_match.prefix_leaves("aux_reduction", aux_reduction, aux, "aux")


def _sum_dtype(dtype: Any, reduction: str, accumulator_dtype: Any) -> Any:
  if reduction == "mean" or jnp.issubdtype(dtype, jnp.floating):
    return accumulator_dtype
  return jnp.int32 if dtype == jnp.bool_ else dtype


def _extreme(dtype: Any, reduction: str) -> Any:
  """The identity of max (the lowest value) or min (the highest)."""
  if dtype == jnp.bool_:
    return reduction == "min"
  if jnp.issubdtype(dtype, jnp.floating):
    return -jnp.inf if reduction == "max" else jnp.inf
  info = jnp.iinfo(dtype)
  return info.min if reduction == "max" else info.max


def init(shapes: list[Any], reductions: list[str], accumulator_dtype: Any):
  """The identity of each reduction, shaped (and sharded) like its leaf."""
  sums, extrema = [], []
  for shape, r in zip(shapes, reductions):
    spec = readers.explicit_spec(shape)
    if r in ("mean", "sum"):
      dtype = _sum_dtype(shape.dtype, r, accumulator_dtype)
      sums.append(jnp.zeros(shape.shape, dtype, out_sharding=spec))
    else:
      sums.append(None)
    if r in ("max", "min"):
      extrema.append(compat.full(shape.shape, _extreme(shape.dtype, r),
                                 shape.dtype, spec))
    else:
      extrema.append(None)
  return Running(sums, extrema)


def update(running: Running, leaves: list[Any], reductions: list[str],
           tokens: jax.Array) -> tuple[Running, list[Any]]:
  """Adds one micro-batch's aux leaves; returns the stacked ones apart.

  A micro-batch without tokens (or with a bad count) adds nothing to any
  reduction, as to the gradient: its aux may be a 0/0 mean. Stacked, its
  aux is its own.
  """
  weight = token_weighting.contribution(tokens, "mean")
  keep = weight.keep
  sums, extrema, stacked = [], [], []
  for r, s, e, x in zip(reductions, running.sums, running.extrema, leaves):
    stacked.append(x if r == "stack" else None)
    if r == "mean":
      s = s + token_weighting.weighted(x, weight, s.dtype)
    elif r == "sum":
      x = jnp.asarray(x).astype(s.dtype)
      s = s + jnp.where(keep, x, jnp.zeros_like(x))
    elif r == "max":
      e = jnp.where(keep, jnp.maximum(e, jnp.asarray(x).astype(e.dtype)), e)
    elif r == "min":
      e = jnp.where(keep, jnp.minimum(e, jnp.asarray(x).astype(e.dtype)), e)
    sums.append(s)
    extrema.append(e)
  return Running(sums, extrema), stacked


def split_extrema(running: Running,
                  reductions: list[str]) -> tuple[list[Any], list[Any]]:
  """The running ``"max"`` leaves and ``"min"`` leaves, as two lists."""
  pick = lambda name: [e for e, r in zip(running.extrema, reductions)
                       if r == name]
  return pick("max"), pick("min")


def join_extrema(sums: list[Any], reductions: list[str], maxima: list[Any],
                 minima: list[Any]) -> Running:
  """The :class:`Running` that :func:`split_extrema` split (reduced)."""
  by_name = {"max": iter(maxima), "min": iter(minima)}
  extrema = [next(by_name[r]) if r in by_name else None for r in reductions]
  return Running(sums, extrema)


def finish_aux(running: Running, stacked: list[Any], reductions: list[str],
           shapes: list[Any], tokens: jax.Array, treedef: Any) -> Parts:
  """``aux`` from the running reductions (already over devices) and stacks.

  A ``"mean"`` leaf is divided by the total token count ``tokens`` (zeros
  without tokens, whatever the sum holds) and comes back in its leaf's
  floating dtype (float32 for an integer leaf); a
  ``"sum"`` leaf in its leaf's dtype (int32 for bool).
  """
  reduced = []
  for r, s, e, shape in zip(reductions, running.sums, running.extrema, shapes):
    if r == "mean":
      floating = jnp.issubdtype(shape.dtype, jnp.floating)
      dtype = shape.dtype if floating else jnp.float32
      reduced.append(token_weighting.mean(s, tokens, jnp.zeros([], dtype),
                                          zeros_if_empty=True))
    elif r == "sum":
      reduced.append(s.astype(_sum_dtype(shape.dtype, r, shape.dtype)))
    else:
      reduced.append(e)
  return Parts(treedef.unflatten(stacked), treedef.unflatten(reduced))


def merge(parts: Parts) -> Any:
  """The one ``aux`` tree from its stacked and reduced parts."""
  if parts.reduced is None:
    return parts.stacked
  return jax.tree.map(
      lambda a, b: b if a is None else a, parts.stacked, parts.reduced,
      is_leaf=lambda x: x is None,
  )
