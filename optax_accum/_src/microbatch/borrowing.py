"""An empty micro-batch's gradient, as zeros that XLA can add in place.

A micro-batch without tokens must add nothing, yet its mean loss is 0/0 and
its gradient NaN: the plain way is ``sum + where(keep, weight * g, 0)``. That
select (and the multiply) sit between XLA's scatter-add of an embedding
gradient and the add into the running sum, so the rewrite that scatters
straight into the carry cannot fire, and the micro-batch's embedding gradient
is built on its own: a higher peak than the hand-written scan's
(``docs/performance.md``, "Compiled for TPU and GPU").

Here instead a micro-batch that is not kept *borrows* the data of the first
kept one, and every micro-batch is differentiated with its weight as the
cotangent seed (zero for a borrowing one): the gradient comes out weighted,
finite, and exactly zero where it must be, and is added as it is. Its loss,
tokens and weight stay its own. This is the hand-written scan's program.

It applies (:func:`applies`) where nothing else reads a micro-batch's own
outputs: no model state, no aux but token-weighted means, no noise-scale
statistics, every leaf a ``"mean"``, no float16 gradient, from jax 0.10.2;
and (``loop._borrowing``) for k > 1 where the loop sees the global batch.
Elsewhere the loop keeps the select.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import names
from optax_accum._src.mesh import compat
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import token_weighting

# Gradient dtypes that a token count's weight cannot overflow (float16 can:
# 4096 tokens times a gradient of 16).
_WIDE = (jnp.float32, jnp.float64, jnp.bfloat16)
# Loss dtypes that hold the weight itself exactly enough to seed with it
# (bfloat16 rounds a count of 1234 to 1232).
SEEDS = (jnp.float32, jnp.float64)


class Plan(NamedTuple):
  """Each micro-batch's count, and where its data comes from.

  :data:`UNCOUNTED` where no ``num_tokens_fn`` reads them: each counts one
  (after the warning that the loop's first count gives), each runs its own
  data.
  """

  counts: jax.Array | None  # (k,) float32: each micro-batch's own count.
  source: jax.Array | None  # (k,) int32: the micro-batch whose data it runs.
  # Whether the loop runs: a micro-batch has tokens, or a count is bad (NaN,
  # negative), which must reach the sums and make the result NaN.
  runs: jax.Array | bool

  def source_of(self, index: jax.Array) -> jax.Array:
    return index if self.source is None else self.source[index]


UNCOUNTED = Plan(None, None, True)


def applies(*, has_state: bool, aux_reductions: list[str] | None,
            has_aux: bool, with_stats: bool, rules: list[str] | None,
            params: Any) -> bool:
  """Whether no output but the weighted gradient and loss is read per
  micro-batch, and the gradient's dtypes hold a weighted gradient."""
  if has_state or with_stats or not compat.while_loop_keeps_unreduced_sums():
    return False
  if has_aux and (aux_reductions is None
                  or any(r != "mean" for r in aux_reductions)):
    return False
  if rules is not None and any(r != grad_reduction_lib.MEAN for r in rules):
    return False
  return all(jnp.result_type(p) in _WIDE
             for p in jax.tree.leaves(params))


def plan(count: Any, take: Any, num_microbatches: int,
         num_real: jax.Array | None, loss_reduction: str) -> Plan:
  """Counts every micro-batch (``count(take(i))``) before the loop.

  If every count is zero, the loop runs no micro-batch: a zero seed on data
  without tokens may meet 0/0. A bad count runs it (and borrows micro-batch
  0's data if none is kept): the count reaches the sums, the result NaN.
  """
  indices = jnp.arange(num_microbatches)
  with jax.named_scope(names.TOKEN_COUNTS_SCOPE):
    counts = lax.map(lambda i: count(take(i)), indices)
  kept = token_weighting.contribution(counts, loss_reduction).keep
  bad = token_weighting.is_bad_count(counts)
  if num_real is not None:
    real = indices < num_real
    kept, bad = kept & real, bad & real
  first = jnp.argmax(kept).astype(indices.dtype)
  return Plan(counts, jnp.where(kept, indices, first), jnp.any(kept | bad))


def seed(c: token_weighting.Contribution) -> jax.Array:
  """The cotangent a micro-batch's loss is differentiated with."""
  return jnp.where(c.keep, c.weight, jnp.zeros([], c.weight.dtype))


def weighted_grads(vjp_fn: Any, value: jax.Array,
                   c: token_weighting.Contribution
                   ) -> tuple[Any, token_weighting.Contribution]:
  """The gradient and the contribution to add it with (``lay.add_grads``).

  The weight is the seed where the loss's dtype holds it (float32, float64:
  then the gradient is added as it is), else the gradient is of weight one
  and multiplied, as the plain loop does.
  """
  s = seed(c)
  ones = jnp.ones([], c.weight.dtype)
  if jnp.result_type(value) in SEEDS:
    (grads,) = vjp_fn(s.astype(jnp.result_type(value)))
    return grads, c._replace(weight=ones, keep=True)
  (grads,) = vjp_fn(jnp.ones_like(value))
  return grads, c._replace(weight=s, keep=True)
