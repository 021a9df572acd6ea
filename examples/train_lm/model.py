"""A small pre-LayerNorm decoder-only transformer over bytes, and its loss."""

from flax import nnx
import jax
import jax.numpy as jnp
import optax


class Block(nnx.Module):
  """Causal self-attention and an MLP, each with a residual connection."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=dim, use_bias=False, decode=False,
        rngs=rngs
    )
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.attention_norm(x), mask=mask)
    return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """Byte embeddings, learned positions, ``num_layers`` blocks, logits."""

  def __init__(
      self, *, vocab_size: int, seq_len: int, dim: int, num_heads: int,
      num_layers: int, rngs: nnx.Rngs,
  ):
    self.embed = nnx.Embed(vocab_size, dim, rngs=rngs)
    self.positions = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (seq_len, dim))
    )
    self.blocks = nnx.List(
        [Block(dim, num_heads, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.unembed = nnx.Linear(dim, vocab_size, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.positions[...]
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.unembed(self.final_norm(x))


def loss_fn(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean next-byte cross-entropy over the unmasked (completion) tokens."""
  logits = model(batch["inputs"])
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]
  )
  mask = batch["mask"]
  return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
