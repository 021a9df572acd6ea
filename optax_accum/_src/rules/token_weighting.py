r"""Token weighting: the one rule both entry points follow.

A micro-batch ``i`` brings a gradient ``g_i`` and a token count ``n_i``. With
``loss_reduction="mean"`` its loss was a mean over its ``n_i`` tokens, so it
adds ``n_i g_i`` to the running sum; with ``"sum"`` its loss was a sum and it
adds ``g_i``. Either way it adds ``n_i`` to the running token count, and the
result is the sum divided by the count: the full batch's per-token mean,

.. math::
  \bar g = \frac{\sum_i n_i \, g_i}{\sum_i n_i}
  \quad\text{or}\quad \frac{\sum_i g_i}{\sum_i n_i}.

What is kept:

* a micro-batch with ``n_i = 0`` adds nothing, neither for ``"mean"`` (its
  mean over no tokens is often 0/0 = NaN) nor for ``"sum"`` (its padded
  inputs may be NaN): its gradient is not looked at;
* a *dropped* micro-batch (a non-finite gradient under ``skip_nonfinite``, a
  user's ``should_skip``) adds nothing either, tokens included;
* a token count that is NaN, infinite or negative is never used as a weight:
  dropped when the caller drops bad micro-batches, otherwise it turns the
  running count into NaN, so that the mean comes out visibly non-finite
  rather than finite and wrong;
* a micro-batch given no token count (no ``num_tokens``, no
  ``num_tokens_fn``) counts as one: every micro-batch weighs the same, the
  mean of their means. That is right only when they hold the same number of
  tokens, so unless the user said ``equal_weights=True`` at construction the
  first trace without a count warns, once (:class:`MissingCount`).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._src import caller_warnings
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers

# The construction argument by which a user says that equal weights are meant.
EQUAL_WEIGHTS = "equal_weights"


class Contribution(NamedTuple):
  """What one micro-batch adds to the running sums."""

  weight: jax.Array  # shape=(), float32: multiplies the gradient and loss.
  tokens: jax.Array  # shape=(), float32: added to the token count.
  keep: jax.Array  # shape=(), bool: whether the weighted gradient is added.
  dropped: jax.Array  # shape=(), bool: dropped as bad (and counted).


def is_bad_count(tokens: jax.Array) -> jax.Array:
  """Whether a token count is NaN, infinite or negative."""
  return ~jnp.isfinite(tokens) | (tokens < 0)


class MissingCount:
  """The count of a micro-batch given none: one, with a warning once.

  One per entry point built (an ``oa.accumulate`` transformation, an
  ``oa.value_and_grad`` function): it warns the first time it stands in for
  a missing count, at the first trace, unless the user built the entry point
  with ``equal_weights=True``.
  """

  def __init__(self, entry_point: str, how_to_count: str,
               equal_weights: bool):
    self.entry_point = entry_point  # e.g. "oa.accumulate".
    self.how_to_count = how_to_count  # the argument that gives counts.
    self.warned = equal_weights

  def __call__(self) -> jax.Array:
    """The count, after the warning."""
    self.warn()
    return self.count()

  def count(self) -> jax.Array:
    return jnp.ones([], jnp.float32)

  def per_microbatch(self, microbatch: Any) -> jax.Array:
    """The count of any micro-batch, after the warning."""
    del microbatch
    return self()

  def warn(self) -> None:
    if not self.warned:
      caller_warnings.warn(self.message(), UserWarning)
      self.warned = True  # not if warnings are errors: each call raises.

  def message(self) -> str:
    return (
        f"{self.entry_point} got no token counts, so every micro-batch"
        " counts as one token: the gradient is a mean over micro-batches, not"
        " over tokens, which differs from the full batch's gradient when"
        " micro-batches hold different numbers of tokens (padding, variable"
        f" lengths). Pass {self.how_to_count}, or build it with"
        f" {self.entry_point}(..., {EQUAL_WEIGHTS}=True) if every"
        " micro-batch is meant to weigh the same."
    )


def counts_each(count: Any) -> bool:
  """Whether ``count``, from :func:`count_fn`, reads each micro-batch (it
  is no :class:`MissingCount`'s, whose counts are all one)."""
  return not isinstance(getattr(count, "__self__", None), MissingCount)


def count_fn(entry_point: str, num_tokens_fn: Any, equal_weights: bool):
  """``num_tokens_fn``, or for None one per micro-batch (see MissingCount)."""
  if num_tokens_fn is None:
    missing = MissingCount(
        entry_point,
        "num_tokens_fn, mapping a micro-batch to the number of tokens its"
        " loss averaged over (e.g. lambda mb: mb['mask'].sum())",
        equal_weights,
    )
    return missing.per_microbatch
  if equal_weights:
    raise ValueError(
        f"{EQUAL_WEIGHTS}=True says every micro-batch weighs the same, but"
        f" num_tokens_fn={num_tokens_fn!r} weighs each by its tokens: pass"
        " one or the other."
    )
  return num_tokens_fn


def contribution(
    tokens: jax.Array,
    loss_reduction: str,
    drop: jax.Array | bool = False,
) -> Contribution:
  """The contribution of a micro-batch with ``tokens`` tokens.

  Args:
    tokens: the micro-batch's token count, a float32 scalar.
    loss_reduction: ``"mean"`` or ``"sum"``, how its loss was reduced.
    drop: whether the caller drops this micro-batch (a non-finite gradient
      or count under ``skip_nonfinite``, a ``should_skip`` predicate).

  Returns:
    A :class:`Contribution`.
  """
  bad = is_bad_count(tokens)
  dropped = jnp.asarray(drop, jnp.bool_)
  weight = tokens if loss_reduction == "mean" else jnp.ones([], jnp.float32)
  keep = ~dropped & ~bad & (tokens != 0)
  # A bad count that is not dropped poisons the running count: NaN, visibly.
  counted = jnp.where(bad, jnp.float32(jnp.nan), tokens)
  return Contribution(
      weight=weight,
      tokens=jnp.where(dropped, jnp.zeros([], jnp.float32), counted),
      keep=keep,
      dropped=dropped,
  )


def weighted(x: jax.Array, c: Contribution, dtype: Any) -> jax.Array:
  """``weight * x`` in ``dtype``, or exact zeros if not kept (NaN-proof).

  ``keep`` may be the Python ``True`` (``x`` known finite and weighted):
  then no select is written.

  The zero is a negative zero: added to a sum it leaves every value as it
  is, as ``+0`` does (a sum that starts at ``+0`` never becomes ``-0``), but
  it is not the constant the sums start from. With ``+0``, XLA's GPU
  compiler merged the two broadcasts and kept the zeros in memory for the
  whole step wherever an add ran outside the micro-batch loop: 1.5 times
  the gradient's bytes more on 8 H100s, a quarter more on the default loop
  (``benchmarks/results/divide_first.md``).
  """
  term = c.weight.astype(dtype) * jnp.asarray(x).astype(dtype)
  if c.keep is True:
    return term
  return jnp.where(c.keep, term, jnp.full([], -0.0, dtype))


def add_weighted(total: Any, grads: Any, c: Contribution) -> Any:
  """Adds a micro-batch's weighted gradient to a running sum, leaf by leaf.

  Each gradient leaf is reshaped to its sum's shape, so a sum may carry
  leading axes of size one (a device's slot).
  """
  return jax.tree.map(
      lambda s, g: s + weighted(g, c, s.dtype).reshape(s.shape), total, grads
  )


def has_tokens(token_count: jax.Array) -> jax.Array:
  """Whether a cycle's count makes a mean: non-zero, NaN included."""
  return token_count != 0


def _zero_if_empty(s: jax.Array, count: jax.Array) -> jax.Array:
  """``s``, or zero where ``count`` is zero."""
  # The zero is the count itself, not a constant: XLA merges a constant
  # zero of a leaf's shape with the loop's initial zeros and holds it
  # through the whole program (H100 at 1B: 10% to 16% more peak memory).
  return jnp.where(count == 0, jnp.abs(count).astype(s.dtype), s)


def zeros_without_tokens(total: Any, token_count: jax.Array) -> Any:
  """``total``, or zeros where ``token_count`` is zero (whatever it holds:
  NaN from a micro-batch without tokens run all the same). A sum typed
  unreduced is selected on each device's partial (JAX has no unreduced
  rule for ``where``)."""
  def select(s):
    if not readers.unreduced_axes(s):
      return _zero_if_empty(s, token_count)
    return manual.on_own_partials(_zero_if_empty, (s, token_count),
                                  readers.full_spec(s))

  return jax.tree.map(select, total)


def mean(total: Any, token_count: jax.Array, like: Any, *,
         zeros_if_empty: bool = False) -> Any:
  """The running sum divided by the count, cast leaf by leaf like ``like``.

  A count of zero gives zeros (no 0/0) where the sum is zero; with
  ``zeros_if_empty`` whatever it holds (NaN from a micro-batch without
  tokens run all the same: the micro-batch loop runs its last micro-batch
  after the loop even where none has tokens). A NaN count gives NaN. A sum
  typed unreduced (each device's partial) is divided on each device: JAX
  has no unreduced rule for division.
  """
  safe_count = jnp.where(token_count == 0, jnp.ones_like(token_count),
                         token_count)
  counts = (safe_count, token_count) if zeros_if_empty else (safe_count,)

  def divide(s, x):
    def local(s, safe, count=None):
      quotient = s / safe.astype(s.dtype)
      if count is not None:
        quotient = _zero_if_empty(quotient, count)
      return quotient.astype(jnp.result_type(x))

    if not readers.unreduced_axes(s):
      return local(s, *counts)
    return manual.on_own_partials(local, (s, *counts), readers.full_spec(s))

  return jax.tree.map(divide, total, like)
