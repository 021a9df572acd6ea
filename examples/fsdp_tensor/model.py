"""A small decoder-only transformer whose parameters carry logical axes.

Every kernel is created with ``nnx.with_partitioning(init, logical_axes)``:
names such as ``"embed"`` or ``"mlp"`` that say what each dimension is, not
where it goes. ``LOGICAL_RULES`` maps them to the mesh (as in flax's lm1b and
MaxText), which flax applies as it creates each parameter under
``jax.set_mesh`` and ``nn.logical_axis_rules`` (``train.make_model``):
``embed`` over ``fsdp`` (the parameters are sharded over a data
axis: FSDP), ``mlp``, ``heads`` and ``vocab`` over ``tensor``
(Megatron-style tensor parallelism). Attention heads and MLP hidden units are
split over ``tensor``; the output projections sum their partial results over
it, the model's own all-reduces on every forward pass.
"""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

LOGICAL_RULES = (
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
)
# The batch axes: activations are sharded over both, as for jax.jit of the
# full batch (oa.value_and_grad runs loss_fn on a global micro-batch, still
# sharded over them). Sums over heads or hidden units come back replicated
# over "tensor".
BATCH = ("data", "fsdp")


def activations(*rest) -> P:
  """An activation's sharding: the batch axes first, then ``rest``."""
  return P(BATCH, *rest)


def _init(init, *logical_axes):
  return nnx.with_partitioning(init, logical_axes)


class Attention(nnx.Module):
  """Causal multi-head self-attention, heads split over ``tensor``."""

  def __init__(self, dim: int, num_heads: int, rngs: nnx.Rngs):
    kernel = nnx.initializers.lecun_normal()
    self.qkv = nnx.LinearGeneral(
        dim, (3, num_heads, dim // num_heads), use_bias=False, rngs=rngs,
        kernel_init=_init(kernel, "embed", None, "heads", "head_dim"))
    self.out = nnx.LinearGeneral(
        (num_heads, dim // num_heads), dim, axis=(-2, -1), use_bias=False,
        rngs=rngs, kernel_init=_init(kernel, "heads", "head_dim", "embed"))

  def __call__(self, x: jax.Array) -> jax.Array:
    qkv = self.qkv(x, out_sharding=activations(None, None, "tensor", None))
    q, k, v = (qkv[:, :, i] for i in range(3))  # each [batch, seq, heads, d]
    heads = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    # Sums over "tensor": the row-parallel projection's all-reduce.
    return self.out(heads, out_sharding=activations(None, None))


class Block(nnx.Module):
  """Pre-LayerNorm attention and MLP, each with dropout and a residual."""

  def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout: float,
               rngs: nnx.Rngs):
    kernel = nnx.initializers.lecun_normal()
    self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = Attention(dim, num_heads, rngs)
    self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp_in = nnx.Linear(dim, mlp_dim, rngs=rngs,
                             kernel_init=_init(kernel, "embed", "mlp"),
                             bias_init=_init(nnx.initializers.zeros, "mlp"))
    self.mlp_out = nnx.Linear(mlp_dim, dim, use_bias=False, rngs=rngs,
                              kernel_init=_init(kernel, "mlp", "embed"))
    self.dropout = nnx.Dropout(dropout, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.dropout(self.attention(self.attention_norm(x)))
    hidden = nnx.gelu(self.mlp_in(
        self.mlp_norm(x), out_sharding=activations(None, "tensor")))
    return x + self.dropout(
        self.mlp_out(hidden, out_sharding=activations(None, None)))


class Transformer(nnx.Module):
  """Byte embeddings, learned positions, ``num_layers`` blocks, logits."""

  def __init__(self, *, vocab_size: int, seq_len: int, dim: int,
               num_heads: int, mlp_dim: int, num_layers: int, dropout: float,
               rngs: nnx.Rngs):
    self.embed = nnx.Embed(
        vocab_size, dim, rngs=rngs, embedding_init=_init(
            nnx.initializers.normal(1.0), "vocab", "embed"))
    self.positions = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (seq_len, dim)),
        out_sharding=(None, None))  # small: replicated, not FSDP.
    self.blocks = nnx.List([
        Block(dim, num_heads, mlp_dim, dropout, rngs)
        for _ in range(num_layers)])
    self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
    self.unembed = nnx.Linear(
        dim, vocab_size, use_bias=False, rngs=rngs,
        kernel_init=_init(nnx.initializers.lecun_normal(), "embed", "vocab"))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    # A gather from a table split over "tensor": Explicit axes ask where
    # its result goes.
    x = self.embed(tokens, out_sharding=activations(None, None))
    x = x + self.positions[...]
    for block in self.blocks:
      x = block(x)
    # The logits whole along the vocabulary (gathered over "tensor"), so
    # that the loss can pick each target's logit by its integer label.
    return self.unembed(self.final_norm(x),
                        out_sharding=activations(None, None))


def token_loss(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
  """Mean next-byte cross-entropy over the real tokens of ``batch``."""
  logits = model(batch["inputs"])
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"])
  mask = batch["mask"]
  return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
