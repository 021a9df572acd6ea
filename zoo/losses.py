"""What the zoo's losses share: the mean over unmasked tokens, the count.

A batch's ``mask`` holds a 1 for each token that counts and a 0 for padding;
the loss is the mean of the per-token losses over the tokens that count (0,
not 0/0, where none does), so that micro-batches of different token counts
weigh by their tokens (``num_tokens``, the ``num_tokens_fn`` of
``oa.value_and_grad`` and the ``num_tokens=`` of ``oa.accumulate``).
"""

import jax
import jax.numpy as jnp


def masked_mean(losses: jax.Array, mask: jax.Array) -> jax.Array:
  """The mean of ``losses`` over the tokens of ``mask``; 0 without any."""
  return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def num_tokens(batch: dict[str, jax.Array]) -> jax.Array:
  """The number of tokens in ``batch``: the sum of its mask."""
  return batch["mask"].sum()
