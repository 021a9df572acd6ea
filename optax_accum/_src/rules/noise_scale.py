r"""The gradient noise scale, estimated from the micro-batches of one update.

McCandlish et al. model the gradient of a batch of ``n`` tokens as the true
gradient ``G`` plus noise of covariance ``Sigma / n`` (``Sigma`` the per-token
covariance), so that :math:`E|g_n|^2 = |G|^2 + \operatorname{tr}\Sigma / n`.
An accumulator holds gradients at two batch sizes for free: the ``m``
micro-batch gradients ``g_i`` (means over ``n_i`` tokens) and their
token-weighted mean ``g`` over ``N = \sum_i n_i`` tokens. Then

.. math::
  E\Big[\sum_i n_i |g_i|^2\Big] = N |G|^2 + m \operatorname{tr}\Sigma,
  \qquad E\big[N |g|^2\big] = N |G|^2 + \operatorname{tr}\Sigma,

whatever the ``n_i``, so the estimators

.. math::
  \widehat{\operatorname{tr}\Sigma}
    = \frac{\sum_i n_i |g_i|^2 - N |g|^2}{m - 1}, \qquad
  \widehat{|G|^2} = |g|^2 - \frac{\widehat{\operatorname{tr}\Sigma}}{N}

are unbiased for micro-batches of unequal token counts, and the simple noise
scale is :math:`B = \operatorname{tr}\Sigma / |G|^2`, in tokens. With equal
``n_i = n`` they are the paper's two-batch-size estimators with
``B_small = n`` and ``B_big = N``. Only two scalars per micro-batch are
needed beyond what accumulation keeps: ``n_i |g_i|^2`` and a count of the
micro-batches that had tokens. Micro-batches without tokens, or dropped, do
not count. With fewer than two such micro-batches nothing can be estimated,
and every statistic is NaN.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._src.rules import token_weighting


class GradStats(NamedTuple):
  """The gradient noise statistics of one optimizer update.

  Attributes:
    noise_scale: the simple noise scale ``trace_cov / grad_sq_norm``, in
      tokens: the critical batch size's estimate.
    grad_sq_norm: unbiased estimate of the true gradient's squared norm.
    trace_cov: unbiased estimate of the trace of the per-token gradient
      covariance.
    num_microbatches: the small batches the estimate used (those with
      tokens, not dropped): the micro-batches, over every device under
      ``axis_name``; in the typed form each device's rows of each
      micro-batch (``docs/noise_scale.md``).
  """

  noise_scale: jax.Array  # shape=(), dtype=jnp.float32.
  grad_sq_norm: jax.Array  # shape=(), dtype=jnp.float32.
  trace_cov: jax.Array  # shape=(), dtype=jnp.float32.
  num_microbatches: jax.Array  # shape=(), dtype=jnp.float32.


class StatsSums(NamedTuple):
  """Running sums over micro-batches that the estimate needs."""

  weighted_sq_norms: jax.Array  # shape=(), float32: sum of n_i |g_i|^2.
  num_microbatches: jax.Array  # shape=(), float32: micro-batches counted.


def nan_stats() -> GradStats:
  """Statistics before any estimate: NaN, with no micro-batches."""
  nan = jnp.full([], jnp.nan, jnp.float32)
  return GradStats(nan, nan, nan, jnp.zeros([], jnp.float32))


def zero_sums() -> StatsSums:
  return StatsSums(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))


def sq_norm(tree: Any) -> jax.Array:
  """The squared L2 norm of a tree, accumulated in float32."""
  leaves = jax.tree.leaves(tree)
  return sum(
      (jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in leaves),
      jnp.zeros([], jnp.float32),
  )


def add_sq_norms(
    sums: StatsSums,
    grads: Any,
    contribution: token_weighting.Contribution,
    loss_reduction: str,
) -> StatsSums:
  """Adds micro-batch ``i``'s ``n_i |g_i|^2`` (``g_i``: its per-token mean).

  With ``loss_reduction="sum"`` the incoming gradient is ``n_i g_i``, so the
  term is its squared norm divided by ``n_i``.
  """
  tokens = contribution.tokens
  safe_tokens = jnp.where(contribution.keep, tokens, jnp.ones_like(tokens))
  scale = safe_tokens if loss_reduction == "mean" else 1.0 / safe_tokens
  term = jnp.where(contribution.keep, scale * sq_norm(grads), 0.0)
  return StatsSums(
      weighted_sq_norms=sums.weighted_sq_norms + term,
      num_microbatches=sums.num_microbatches
      + contribution.keep.astype(jnp.float32),
  )


def estimate_from_groups(
    groups: list[StatsSums], mean_sq_norms: list[jax.Array],
    tokens: jax.Array
) -> GradStats:
  """The statistics of leaves estimated in groups, each on its own small
  batches: ``|G|^2`` and ``tr(Sigma)`` are sums over leaves, so each group's
  unbiased estimate adds up to the whole's. ``num_microbatches`` is the
  first group's count of small batches.

  Args:
    groups: each group's sums over its small batches.
    mean_sq_norms: each group's ``|g|^2`` (its leaves of the mean gradient).
    tokens: the token count ``N`` of the whole batch.
  """
  usable = jnp.array(True)
  trace_cov = grad_sq_norm = jnp.zeros([], jnp.float32)
  safe_tokens = jnp.where(tokens > 0, tokens, 1.0)
  for sums, mean_sq_norm in zip(groups, mean_sq_norms):
    m = sums.num_microbatches
    usable = usable & (m >= 2)
    big = tokens * mean_sq_norm
    group_trace = (sums.weighted_sq_norms - big) / jnp.where(m >= 2, m - 1,
                                                              1.0)
    trace_cov += group_trace
    grad_sq_norm += mean_sq_norm - group_trace / safe_tokens
  nan = jnp.float32(jnp.nan)
  return GradStats(
      noise_scale=jnp.where(usable, trace_cov / grad_sq_norm, nan),
      grad_sq_norm=jnp.where(usable, grad_sq_norm, nan),
      trace_cov=jnp.where(usable, trace_cov, nan),
      num_microbatches=(groups[0].num_microbatches if groups
                        else jnp.zeros([], jnp.float32)),
  )
