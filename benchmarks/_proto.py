"""Prototypes of ``oa.accumulate``'s update, to measure layouts of the cond.

Not part of the library. Each variant computes the same thing as
``optax_accum.accumulate`` without ``axis_name`` (same state, same outputs);
only the way the computation is split between the entry computation and the
``lax.cond`` differs, which decides what XLA copies:

* ``reference``: the core's layout: the sum ``acc + w * g`` is computed inside
  both branches (the emit branch resets it to zeros), and the emit branch
  nests a second ``lax.cond`` on ``token_count > 0``. The conditional's
  ``grad_sum`` output cannot share the donated input buffer, so XLA copies
  it after the cond on every micro-step.
* ``sum_outside``: the new sum is one elementwise pass outside the cond,
  ``grad_sum = where(emit, 0, acc + w * g)``, which XLA fuses and writes in
  place into the donated buffer. The single ``lax.cond`` on
  ``emit & (token_count > 0)`` only produces the updates and the inner
  state; its skip branch passes the inner state through.
* ``sum_outside_while``: as ``sum_outside``, with the cond replaced by a
  ``lax.while_loop`` that runs zero or one time.
* ``recompute``: as ``sum_outside``, but the cond takes the old sum and the
  incoming gradient and the emit branch recomputes ``acc + w * g`` itself, so
  the new sum is never materialised outside the in-place output buffer (the
  skip path is one fused read-2N write-N pass plus the zero updates).
* ``recompute_select``: as ``recompute``, but the skip branch hands back the
  incoming gradient unchanged (no write) and the zeros come from
  ``where(updated, u, 0)`` outside the cond, which XLA can fuse into the
  caller's ``apply_updates``.
* ``lazy_reset``: the sum is not zeroed on the emitting call; the next call
  that starts a cycle (``micro_step == 0``) adds to zeros instead:
  ``grad_sum = where(micro_step == 0, 0, acc) + w * g``, one fused in-place
  pass whose output the single ``lax.cond`` only reads. (``state.grad_sum``
  then holds the finished cycle's sum until the next call.)
"""

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src.accumulate import AccumulateState

VARIANTS = ("reference", "sum_outside", "sum_outside_while", "recompute",
            "recompute_select", "lazy_reset")


def accumulate(inner, every_k, *, loss_reduction="mean",
               accumulator_dtype=jnp.float32, skip_nonfinite=False,
               variant="sum_outside"):
  """Same contract as ``oa.accumulate`` (no ``axis_name``)."""
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}.")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return AccumulateState(
        micro_step=jnp.zeros([], jnp.int32),
        count=jnp.zeros([], jnp.int32),
        grad_sum=jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), accumulator_dtype), params),
        token_count=jnp.zeros([], jnp.float32),
        inner_state=inner.init(params),
        emitted=jnp.zeros([], jnp.bool_),
        nonfinite_count=jnp.zeros([], jnp.int32),
    )

  def cycle_length(count):
    if callable(every_k):
      return jnp.maximum(jnp.asarray(every_k(count)).astype(jnp.int32), 1)
    return jnp.asarray(every_k, jnp.int32)

  def update_fn(updates, state, params=None, *, num_tokens=None, **extra_args):
    tokens = jnp.float32(1) if num_tokens is None else jnp.asarray(
        num_tokens, jnp.float32)
    if skip_nonfinite:
      finite = jnp.isfinite(tokens)
      for g in jax.tree.leaves(updates):
        finite &= jnp.all(jnp.isfinite(g))
    else:
      finite = jnp.bool_(True)
    weight = tokens if loss_reduction == "mean" else jnp.float32(1)

    def add_leaf_to(acc, g):
      term = weight.astype(acc.dtype) * g.astype(acc.dtype)
      if skip_nonfinite:
        term = jnp.where(finite, term, jnp.zeros_like(term))
      return acc + term

    def add(grad_sum):
      return jax.tree.map(add_leaf_to, grad_sum, updates)

    token_count = state.token_count + jnp.where(finite, tokens, 0.0)
    micro_step = optax.safe_increment(state.micro_step)
    emit = micro_step >= cycle_length(state.count)
    has_tokens = token_count > 0
    updates_shape = jax.eval_shape(
        lambda s: inner.update(updates, s, params, **extra_args)[0],
        state.inner_state)

    def no_updates():
      return jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), updates_shape)

    def mean_of(grad_sum, token_count):
      safe = jnp.where(token_count > 0, token_count, 1.0)
      return jax.tree.map(lambda s, g: (s / safe.astype(s.dtype)).astype(
          g.dtype), grad_sum, updates)

    def run_inner(mean, inner_state):
      new_updates, new_state = inner.update(mean, inner_state, params,
                                            **extra_args)
      return new_updates, optax.tree.cast_like(new_state, inner_state)

    if variant == "reference":
      def emit_branch(grad_sum, token_count, inner_state):
        mean = mean_of(add(grad_sum), token_count)
        new_updates, inner_state = lax.cond(
            token_count > 0, lambda s: run_inner(mean, s),
            lambda s: (no_updates(), s), inner_state)
        zeros = jax.tree.map(jnp.zeros_like, grad_sum)
        return new_updates, zeros, inner_state, token_count > 0

      def skip_branch(grad_sum, token_count, inner_state):
        del token_count
        return no_updates(), add(grad_sum), inner_state, jnp.bool_(False)

      new_updates, grad_sum, inner_state, updated = lax.cond(
          emit, emit_branch, skip_branch, state.grad_sum, token_count,
          state.inner_state)
    elif variant == "lazy_reset":
      updated = emit & has_tokens
      cycle_start = state.micro_step == 0
      grad_sum = jax.tree.map(
          lambda acc, g: add_leaf_to(jnp.where(cycle_start,
                                               jnp.zeros_like(acc), acc), g),
          state.grad_sum, updates)

      def emit_fn(new_sum, inner_state):
        return run_inner(mean_of(new_sum, token_count), inner_state)

      def skip_fn(new_sum, inner_state):
        del new_sum
        return no_updates(), inner_state

      new_updates, inner_state = lax.cond(
          updated, emit_fn, skip_fn, grad_sum, state.inner_state)
    elif variant.startswith("recompute"):
      updated = emit & has_tokens
      # Written in place into the donated buffer, after the cond has read the
      # old sum: one fused pass on a non-emitting micro-step.
      grad_sum = jax.tree.map(
          lambda s: jnp.where(emit, jnp.zeros_like(s), s),
          add(state.grad_sum))
      passthrough = variant == "recompute_select" and all(
          u.shape == g.shape and u.dtype == g.dtype for u, g in zip(
              jax.tree.leaves(updates_shape), jax.tree.leaves(updates)))

      def emit_fn(old_sum, grads, inner_state):
        del grads
        return run_inner(mean_of(add(old_sum), token_count), inner_state)

      def skip_fn(old_sum, grads, inner_state):
        del old_sum
        if passthrough:
          return jax.tree.unflatten(jax.tree.structure(updates_shape),
                                    jax.tree.leaves(grads)), inner_state
        return no_updates(), inner_state

      new_updates, inner_state = lax.cond(
          updated, emit_fn, skip_fn, state.grad_sum, updates,
          state.inner_state)
      if passthrough:
        new_updates = jax.tree.map(
            lambda u: jnp.where(updated, u, jnp.zeros_like(u)), new_updates)
    else:
      updated = emit & has_tokens
      new_sum = add(state.grad_sum)
      # One elementwise pass, fused and written in place into the donated
      # buffer; the cond below only reads the sum.
      grad_sum = jax.tree.map(
          lambda s: jnp.where(emit, jnp.zeros_like(s), s), new_sum)

      def emit_fn(new_sum, inner_state):
        return run_inner(mean_of(new_sum, token_count), inner_state)

      def skip_fn(new_sum, inner_state):
        del new_sum
        return no_updates(), inner_state

      if variant == "sum_outside":
        new_updates, inner_state = lax.cond(
            updated, emit_fn, skip_fn, new_sum, state.inner_state)
      else:
        def body(carry):
          _, _, inner_state = carry
          new_updates, inner_state = emit_fn(new_sum, inner_state)
          return jnp.bool_(False), new_updates, inner_state
        _, new_updates, inner_state = lax.while_loop(
            lambda carry: carry[0], body,
            (updated, no_updates(), state.inner_state))

    new_state = AccumulateState(
        micro_step=jnp.where(emit, 0, micro_step),
        count=jnp.where(updated, optax.safe_increment(state.count),
                        state.count),
        grad_sum=grad_sum,
        token_count=jnp.where(emit, jnp.zeros_like(token_count), token_count),
        inner_state=inner_state,
        emitted=updated,
        nonfinite_count=jnp.where(
            finite, state.nonfinite_count,
            optax.safe_increment(state.nonfinite_count)),
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
