"""The benchmarks' models: an MLP, a transformer, Llama and NNX decoders.

A compute-bound MLP and a small transformer (benchmarks c, d, g and h): plain
JAX, float32, deterministic initialisation. Each ``make_*`` returns
``(params, batch, loss_fn)`` with ``loss_fn(params, batch) -> scalar``, the
mean loss over the batch's leading axis, so that the mean of equal-size
micro-batch losses is the full-batch loss. ``build_model(spec)`` makes one
from a configuration such as ``{"kind": "mlp", "batch_size": 8, ...}``.

Then a Llama-shaped decoder given by its shapes only, never allocated
(benchmark i), and a decoder written as a new Flax NNX user writes it
(benchmark m). The cookbook-style decoder for ``jax.jit`` is
:mod:`zoo.typed_model`.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import optax

from zoo import losses


def make_mlp(batch_size, d_in, width, depth, d_out, seed=0):
  """A GELU MLP regressed onto random targets with a mean squared error."""
  keys = jax.random.split(jax.random.key(seed), depth + 3)
  dims = [d_in] + [width] * (depth - 1) + [d_out]
  params = []
  for i, (m, n) in enumerate(itertools.pairwise(dims)):
    w = jax.random.normal(keys[i], (m, n), jnp.float32) / math.sqrt(m)
    params.append({"w": w, "b": jnp.zeros((n,), jnp.float32)})
  batch = {
      "x": jax.random.normal(keys[-2], (batch_size, d_in), jnp.float32),
      "y": jax.random.normal(keys[-1], (batch_size, d_out), jnp.float32),
  }

  def loss_fn(params, batch):
    h = batch["x"]
    for i, layer in enumerate(params):
      h = h @ layer["w"] + layer["b"]
      if i < len(params) - 1:
        h = jax.nn.gelu(h)
    return jnp.mean(jnp.sum((h - batch["y"]) ** 2, axis=-1))

  return params, batch, loss_fn


def _layer_norm(x, scale):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale


def make_transformer(batch_size, seq_len, d_model, num_heads, num_layers,
                     vocab_size, seed=0):
  """A pre-LayerNorm causal transformer (attention and MLP), next-token CE."""
  keys = iter(jax.random.split(jax.random.key(seed), 4 * num_layers + 4))

  def dense(m, n):
    return jax.random.normal(next(keys), (m, n), jnp.float32) / math.sqrt(m)

  params = {
      "embed": jax.random.normal(next(keys), (vocab_size, d_model)) * 0.02,
      "pos": jax.random.normal(next(keys), (seq_len, d_model)) * 0.02,
      "ln_f": jnp.ones((d_model,)),
      "blocks": [
          {
              "ln1": jnp.ones((d_model,)),
              "qkv": dense(d_model, 3 * d_model),
              "out": dense(d_model, d_model),
              "ln2": jnp.ones((d_model,)),
              "mlp_in": dense(d_model, 4 * d_model),
              "mlp_out": dense(4 * d_model, d_model),
          }
          for _ in range(num_layers)
      ],
  }
  tokens = jax.random.randint(
      next(keys), (batch_size, seq_len + 1), 0, vocab_size, jnp.int32
  )
  batch = {"tokens": tokens}
  head_dim = d_model // num_heads
  mask = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))

  def loss_fn(params, batch):
    inputs, targets = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
    b, t = inputs.shape
    h = params["embed"][inputs] + params["pos"][:t]
    for blk in params["blocks"]:
      x = _layer_norm(h, blk["ln1"])
      q, k, v = jnp.split(x @ blk["qkv"], 3, axis=-1)
      q, k, v = (a.reshape(b, t, num_heads, head_dim) for a in (q, k, v))
      logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
      logits = jnp.where(mask[:t, :t], logits, -1e9)
      att = jax.nn.softmax(logits, axis=-1)
      y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d_model)
      h = h + y @ blk["out"]
      x = _layer_norm(h, blk["ln2"])
      h = h + jax.nn.gelu(x @ blk["mlp_in"]) @ blk["mlp_out"]
    h = _layer_norm(h, params["ln_f"])
    logits = h @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)

  return params, batch, loss_fn


def build_model(spec):
  """``make_mlp`` or ``make_transformer`` of a spec's ``kind`` and sizes."""
  kwargs = {key: val for key, val in spec.items() if key != "kind"}
  if spec["kind"] == "mlp":
    return make_mlp(**kwargs)
  return make_transformer(**kwargs)


def batch_size_of(batch):
  return jax.tree.leaves(batch)[0].shape[0]


# A Llama-shaped decoder, abstract: shapes and shardings only, never allocated.


def _rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
  return (x32 * scale).astype(x.dtype)


def _embed(table, ids):
  """``table[ids]``; under Explicit axes, sharded like the ids' rows.

  JAX asks where a gather's result goes when the ids are sharded (jax.jit
  with Explicit axes): with the batch, as the model's activations.
  """
  spec = jax.typeof(ids).sharding.spec if _explicit(ids) else None
  if spec is None:
    return table[ids]
  return table.at[ids].get(out_sharding=jax.sharding.PartitionSpec(
      *spec, *([None] * (ids.ndim - len(spec))), None))


def _explicit(x):
  mesh = getattr(jax.typeof(x).sharding, "mesh", None)
  return bool(mesh is not None and not mesh.empty and any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types))


def llama_shapes(layers, d_model, ffn, heads, kv_heads, vocab):
  """The parameter shapes, per-layer weights stacked for a scan over layers."""
  head_dim = d_model // heads
  stacked = {
      "attn_norm": (d_model,), "wq": (d_model, heads * head_dim),
      "wk": (d_model, kv_heads * head_dim),
      "wv": (d_model, kv_heads * head_dim), "wo": (heads * head_dim, d_model),
      "mlp_norm": (d_model,), "w_gate": (d_model, ffn), "w_up": (d_model, ffn),
      "w_down": (ffn, d_model),
  }
  return {
      "embed": (vocab, d_model),
      "layers": {name: (layers, *shape) for name, shape in stacked.items()},
      "final_norm": (d_model,),
      "unembed": (d_model, vocab),
  }


def make_llama_loss(heads, kv_heads):
  """``loss_fn(params, batch)``: token-weighted next-token cross-entropy.

  The layers run in a ``lax.scan`` over the stacked weights (one layer's
  program, compiled once) with ``jax.checkpoint``, as large models train:
  only each layer's input is kept for the backward pass. Attention is causal
  with grouped-query heads; RoPE is left out (it changes no shape).
  """

  def layer(x, p):
    b, t, d = x.shape
    head_dim = d // heads
    h = _rms_norm(x, p["attn_norm"])
    q = (h @ p["wq"]).reshape(b, t, heads, head_dim)
    k = (h @ p["wk"]).reshape(b, t, kv_heads, head_dim)
    v = (h @ p["wv"]).reshape(b, t, kv_heads, head_dim)
    k, v = (jnp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    weights = jax.nn.softmax(jnp.where(causal, logits / math.sqrt(head_dim),
                                       -1e9), axis=-1).astype(x.dtype)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    x = x + attended @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

  def loss_fn(params, batch):
    x = _embed(params["embed"], batch["inputs"])
    x, _ = jax.lax.scan(
        lambda x, p: (jax.checkpoint(layer)(x, p), None), x, params["layers"])
    logits = (_rms_norm(x, params["final_norm"]) @ params["unembed"]).astype(
        jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits),
                               batch["targets"][..., None], -1)[..., 0]
    return losses.masked_mean(nll, batch["mask"])

  return loss_fn


def make_nnx_decoder(vocab, dim, heads, ffn, layers, tensor="tensor", seed=0):
  """A decoder written as a new Flax NNX user writes it; its loss function.

  ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.Linear`` (the attention and MLP
  kernels sharded over ``tensor`` by ``nnx.with_partitioning``; None:
  replicated), causal :func:`jax.nn.dot_product_attention`. Under a mesh
  with Explicit axes the batch is split over ``data``: the two projections
  whose contraction is sharded name their output's sharding, and the
  embedding is read with ``.at[ids].get(out_sharding=...)`` (``nnx.Embed``'s
  own ``jnp.take`` is refused there). Built under ``jax.set_mesh`` the
  parameters carry their sharding. Returns ``(model, loss_fn)``,
  ``loss_fn(model, batch)`` the mean cross-entropy over unmasked tokens.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def kernel(names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
      self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs,
                            kernel_init=kernel((None, tensor)))
      self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs,
                            kernel_init=kernel((tensor, None)))
      self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
      self.up = nnx.Linear(dim, ffn, rngs=rngs,
                           kernel_init=kernel((None, tensor)))
      self.down = nnx.Linear(ffn, dim, rngs=rngs,
                             kernel_init=kernel((tensor, None)))

    def __call__(self, x):
      b, s, _ = x.shape
      q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)

      def split_heads(t):
        return t.reshape(b, s, heads, dim // heads)

      a = jax.nn.dot_product_attention(
          split_heads(q), split_heads(k), split_heads(v), is_causal=True)
      x = x + self.out(a.reshape(b, s, dim), out_sharding=P("data"))
      h = jax.nn.gelu(self.up(self.norm2(x)))
      return x + self.down(h, out_sharding=P("data"))

  class Decoder(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, dim, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
      self.norm = nnx.LayerNorm(dim, rngs=rngs)
      self.unembed = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
      x = self.embed.embedding[...].at[ids].get(out_sharding=P("data"))
      for block in self.blocks:
        x = block(x)
      return self.unembed(self.norm(x))

  def loss_fn(model, batch):
    logits = model(batch["ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                         batch["labels"])
    return losses.masked_mean(ce, batch["mask"])

  return Decoder(nnx.Rngs(seed)), loss_fn
