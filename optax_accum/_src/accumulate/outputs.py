"""What the emitting step of :func:`optax_accum.accumulate` hands back.

One :class:`Output` per call, picked once by ``emit.output_for``:

* :class:`Updates` (``tx.update``): the updates, zeros where none is made;
* :class:`UpdatesInSum` (``tx.update`` where the running sum's buffer holds
  the updates exactly: the single form): the sum's buffer, holding the
  updates where they were made and the sum where not; the updates handed
  back are ``where(updated, buffer, 0)``, fused by XLA into whatever adds
  them (no parameter-sized buffer of their own), and the next call discards
  the buffer either way (``microstep.add_to_sum``'s lazy reset);
* :class:`Applied` (``oa.update_and_apply``): the parameters, updated in
  place.

Each says what rides in the carry of ``emit.choose`` and how the choice is
made (:data:`COND`, :data:`LOOP_ON_GPU`, :data:`LOOP`).
"""

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from optax_accum._src.accumulate import sum_layout
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.rules import noise_scale


class Emitted(NamedTuple):
  """What the emit decision hands back (and, in a loop, carries)."""

  out: Any  # the Output's: updates, the sum's buffer, or the parameters.
  inner_state: Any
  updated: jax.Array  # shape=(), bool: inner ran on a cycle with tokens.
  stats: noise_scale.GradStats | None  # this cycle's, or the previous ones.
  # shape=(), float32: the tokens the update's mean divided by, over every
  # device; 0 when none was made.
  tokens: jax.Array


# How choose chooses: a conditional; a loop of at most one trip on GPUs
# (conditional_loops.per_compiler), a conditional elsewhere; a loop.
COND, LOOP_ON_GPU, LOOP = "cond", "loop on GPU", "loop"


class Output(Protocol):
  """What the emitting step hands back; what rides in its carry."""

  emit_choice: str  # how choose makes the emit choice: COND, LOOP...
  inner_choice: str  # and the choice to run inner (a cycle with tokens).

  def split(self, cycle: sum_layout.Cycle,
            params: Any) -> tuple[Any, sum_layout.Cycle]:
    """What rides in the carry where no update is made, and what the
    branches read besides."""

  def joined(self, carry: Any, reads: sum_layout.Cycle) -> tuple[Any, Any]:
    """The running sum and the parameters, from the carry and the reads
    (the parameters None where they are not carried)."""

  def made(self, updates: Any, carry: Any) -> Any:
    """The output where ``inner`` made ``updates``."""

  def skip(self, carry: Any, like: Any) -> Any:
    """The output where no update is made (``like``: ``made``'s types)."""

  def returned(self, emitted: Emitted, grad_sum: Any) -> tuple[Any, Any]:
    """What the call hands back, and the sum's buffer the state keeps."""


class Updates(NamedTuple):
  """``tx.update``'s: the updates, zeros where none is made."""

  emit_choice: str = COND
  inner_choice: str = COND

  def split(self, cycle, params):
    del params
    return None, cycle

  def joined(self, carry, reads):
    del carry
    return reads.grad_sum, None

  def made(self, updates, carry):
    del carry
    return updates

  def skip(self, carry, like):
    del carry
    return axes.zeros_typed_like(like)

  def returned(self, emitted, grad_sum):
    return emitted.out, grad_sum


class UpdatesInSum(NamedTuple):
  """``tx.update``'s where the sum's buffer holds the updates exactly."""

  like_updates: Any  # ShapeDtypeStructs of inner's updates.
  # The sum in a loop's carry on GPUs (XLA copies a conditional's).
  emit_choice: str = LOOP_ON_GPU
  inner_choice: str = LOOP_ON_GPU

  def split(self, cycle, params):
    del params  # the sum in the carry alone: XLA copies one also read.
    return cycle.grad_sum, cycle._replace(grad_sum=None)

  def joined(self, carry, reads):
    del reads
    return carry, None

  def made(self, updates, carry):
    return jax.tree.map(lambda u, s: u.astype(s.dtype), updates, carry)

  def skip(self, carry, like):
    del like
    return carry

  def returned(self, emitted, grad_sum):
    del grad_sum
    updates = jax.tree.map(
        lambda s, u: jnp.where(emitted.updated, s.astype(u.dtype),
                               jnp.zeros([], u.dtype)),
        emitted.out, self.like_updates)
    return updates, emitted.out


class Applied(NamedTuple):
  """``oa.update_and_apply``'s: the parameters, updated where made."""

  # The parameters in a loop's carry, updated in place: on every compiler
  # for the emit (measured lower on TPU too: 80 against 96 MiB, adamw on 4
  # x f32[1024, 1024]), on GPUs for the inner (on TPU the loop peaked
  # higher at small sizes).
  emit_choice: str = LOOP
  inner_choice: str = LOOP_ON_GPU

  def split(self, cycle, params):
    return params, cycle

  def joined(self, carry, reads):
    return reads.grad_sum, carry

  def made(self, updates, carry):
    return optax.apply_updates(carry, updates)  # each in its param's dtype.

  def skip(self, carry, like):
    del like
    return carry

  def returned(self, emitted, grad_sum):
    return emitted.out, grad_sum


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
