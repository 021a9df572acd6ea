"""The emitted updates, kept in the running sum's buffer.

``tx.update`` must hand back updates on every call: zeros on a non-emitting
one. Were they an output of the emit/skip conditional, that output would be
a parameter-sized buffer of its own (one above ``optax.MultiSteps``'s peak
on TPU and GPU, and on the CPU fresh zeroed pages on every call). Instead the
conditional hands back the running sum's buffer, holding the inner's updates
where it emitted (cast to the sum's dtype, which holds them exactly) and the
sum itself where it skipped; the next call discards it either way (the lazy
reset of ``microstep.add_to_sum``). The updates handed back are
``where(updated, slot, 0)``, one select that XLA fuses into whatever reads it
(``optax.apply_updates``, ``nnx.Optimizer.update``): no buffer of their own.

:func:`optax_accum.apply_if_updated` given those very updates (and the state
of the same call) reads the slot instead, in its emitting branch only, so
that a non-emitting call neither reads nor writes the parameters.

Only the plain form (one sum per leaf, no data axis, ZeRO or unreduced
gradients) keeps its updates here, and only where each update fits its sum
leaf: same shape and layout, a dtype the sum's holds exactly.
"""

from typing import Any, NamedTuple
import weakref

import jax
import jax.numpy as jnp

from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers


def fits(like_updates: Any, grad_sum: Any) -> bool:
  """Whether every update leaf can be kept in its sum leaf, exactly."""
  u_leaves, u_def = jax.tree.flatten(like_updates)
  s_leaves, s_def = jax.tree.flatten(grad_sum)
  if u_def != s_def or not u_leaves:
    return False
  return all(_leaf_fits(u, s) for u, s in zip(u_leaves, s_leaves))


def _leaf_fits(u, s) -> bool:
  u_dtype, s_dtype = jnp.dtype(u.dtype), jnp.dtype(s.dtype)
  if not (jnp.issubdtype(u_dtype, jnp.inexact)
          and jnp.issubdtype(s_dtype, jnp.inexact)):
    return False
  return (jnp.shape(u) == jnp.shape(s)
          and _holds(s_dtype, u_dtype)
          and readers.explicit_spec(u) == readers.explicit_spec(s)
          and axes.varying_axes(u) == axes.varying_axes(s))


def _holds(wide, narrow) -> bool:
  """Whether every value of dtype ``narrow`` casts to ``wide`` and back."""
  if wide == narrow:
    return True
  complex_ = jnp.issubdtype(wide, jnp.complexfloating)
  if complex_ != jnp.issubdtype(narrow, jnp.complexfloating):
    return False
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return (n.nmant <= w.nmant and n.maxexp <= w.maxexp
          and n.minexp >= w.minexp)


def into(updates: Any, grad_sum: Any) -> Any:
  """The inner's updates in the sum's dtypes (exact: see :func:`fits`)."""
  return jax.tree.map(lambda u, s: u.astype(s.dtype), updates, grad_sum)


def updates_from(slot: Any, like_updates: Any, updated: jax.Array) -> Any:
  """``where(updated, slot, 0)``, typed like the updates; remembered for
  :func:`find`."""
  updates = jax.tree.map(
      lambda s, u: jnp.where(updated, s.astype(u.dtype),
                             jnp.zeros([], u.dtype)), slot, like_updates)
  _remember(updates, slot, updated)
  return updates


class Found(NamedTuple):
  """What :func:`find` hands back: the slot behind some updates."""

  slot: Any  # like the updates, in the sum's dtypes.
  updated: jax.Array  # shape=(), bool.


# id of an updates leaf -> weak references to it, its slot leaf and the
# call's flag (one reference shared by the call's leaves).
_KEPT: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}


def _remember(updates, slot, updated):
  for key in [k for k, (u, _, _) in _KEPT.items() if u() is None]:
    del _KEPT[key]
  flag = weakref.ref(updated)
  for u, s in zip(jax.tree.leaves(updates), jax.tree.leaves(slot)):
    _KEPT[id(u)] = (weakref.ref(u), weakref.ref(s), flag)


def find(updates: Any, grad_sum: Any) -> Found | None:
  """The slot behind ``updates``, if one :func:`updates_from` call made
  every leaf and ``grad_sum`` (the state's) is that very slot; else None."""
  u_leaves, treedef = jax.tree.flatten(updates)
  s_leaves = jax.tree.leaves(grad_sum)
  if not u_leaves or len(u_leaves) != len(s_leaves):
    return None
  kept = [_KEPT.get(id(u)) for u in u_leaves]
  if any(k is None or k[0]() is not u or k[1]() is not s
         for k, u, s in zip(kept, u_leaves, s_leaves)):
    return None
  updated = kept[0][2]()
  if updated is None or any(k[2] is not kept[0][2] for k in kept):
    return None
  return Found(treedef.unflatten(s_leaves), updated)
