"""A decoder written the way JAX's Training Cookbook teaches: for jax.jit.

Activations carry ``out_sharding=`` annotations that name the batch axes,
the embedding is read with ``table.at[ids].get(out_sharding=...)``,
attention is :func:`jax.nn.dot_product_attention`, the positional embedding
is added elementwise (a leaf JAX cannot type ``reduced``), the loss is an
integer-label cross-entropy over unmasked tokens, and the weights are sharded
over FSDP and tensor-parallel axes. Our own code, for the typed form's tests
(``tests/forms/``, ``tests/compiled/``, ``tests/integration/``) and benchmarks
(``benchmarks/bench_typed.py``, ``bench_compiled.py``, ``bench_deferred.py``).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from zoo import losses


class Config(NamedTuple):
  """The model's sizes and which mesh axes play which role."""

  vocab: int = 32
  seq: int = 8
  dim: int = 16
  heads: int = 4
  ffn: int = 32
  layers: int = 2
  batch_axes: tuple[str, ...] = ("data",)  # the axes the batch is split on.
  fsdp: str | None = None  # the axis weights are sharded over (FSDP), if any.
  tensor: str | None = None  # the tensor-parallel axis, if any.
  # The positional embedding broadcast to the activations' sharding before
  # the add, so that JAX types it reduced too (no leaf kept replicated).
  pos_broadcast: bool = False
  # The layers' weights stacked, one array per weight with a leading layer
  # axis, and the blocks run by ``jax.lax.scan`` (one compiled body).
  scan_layers: bool = False


def specs(cfg: Config) -> dict[str, Any]:
  """Each weight's PartitionSpec on the mesh of ``cfg``."""
  f, t = cfg.fsdp, cfg.tensor
  layer = {
      "norm1": P(None),
      "qkv": P(f, None, t, None),  # (dim, 3, heads, head_dim)
      "out": P(t, None, f),  # (heads, head_dim, dim)
      "norm2": P(None),
      "up": P(f, t),  # (dim, ffn)
      "down": P(t, f),  # (ffn, dim)
  }
  if cfg.scan_layers:  # (layers, ...): the leading axis unsharded.
    layers = {name: P(None, *spec) for name, spec in layer.items()}
  else:
    layers = [layer] * cfg.layers
  return {
      "embed": P(None, t),  # (vocab, dim)
      "pos": P(None, None),  # (seq, dim): added elementwise.
      "layers": layers,
      "final_norm": P(None),
      "unembed": P(f, None),  # (dim, vocab)
  }


def init(cfg: Config, seed: int = 0) -> dict[str, Any]:
  """Random float32 weights (host arrays, unsharded)."""
  rng = np.random.default_rng(seed)
  head_dim = cfg.dim // cfg.heads

  def normal(*shape, scale=0.2):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  def layer():
    return {
        "norm1": 1.0 + normal(cfg.dim, scale=0.05),
        "qkv": normal(cfg.dim, 3, cfg.heads, head_dim),
        "out": normal(cfg.heads, head_dim, cfg.dim),
        "norm2": 1.0 + normal(cfg.dim, scale=0.05),
        "up": normal(cfg.dim, cfg.ffn),
        "down": normal(cfg.ffn, cfg.dim),
    }

  embed = normal(cfg.vocab, cfg.dim, scale=0.5)
  pos = normal(cfg.seq, cfg.dim, scale=0.1)
  layers = [layer() for _ in range(cfg.layers)]
  if cfg.scan_layers:  # the same draws, stacked.
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return {
      "embed": embed,
      "pos": pos,
      "layers": layers,
      "final_norm": 1.0 + normal(cfg.dim, scale=0.05),
      "unembed": normal(cfg.dim, cfg.vocab),
  }


def batch(cfg: Config, size: int, seed: int = 1) -> dict[str, jax.Array]:
  """Token ids, next-token labels and a mask of very uneven lengths."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab, size=(size, cfg.seq + 1))
  lengths = rng.integers(0, cfg.seq + 1, size=size)
  lengths[::3] = cfg.seq  # some full rows, some empty ones.
  mask = np.arange(cfg.seq)[None, :] < lengths[:, None]
  return {
      "ids": jnp.asarray(ids[:, :-1], jnp.int32),
      "labels": jnp.asarray(ids[:, 1:], jnp.int32),
      "mask": jnp.asarray(mask, jnp.float32),
  }


num_tokens = losses.num_tokens  # the sum of a (micro-)batch's mask.


def _act(cfg: Config, *rest: Any) -> P | None:
  """An activation's sharding: batch axes first (None off a mesh)."""
  if not cfg.batch_axes:
    return None
  return P(cfg.batch_axes, *rest)


def _rms_norm(cfg: Config, x: jax.Array, scale: jax.Array) -> jax.Array:
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  # An einsum, not x * scale: JAX types the scale reduced this way.
  return jnp.einsum("btd,d->btd", x, scale,
                    out_sharding=_act(cfg, None, None))


def _block(cfg: Config, x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
  h = _rms_norm(cfg, x, w["norm1"])
  qkv = jnp.einsum("btd,dshk->sbthk", h, w["qkv"],
                   out_sharding=None if not cfg.batch_axes else P(
                       None, cfg.batch_axes, None, cfg.tensor, None))
  attn = jax.nn.dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
  x = x + jnp.einsum("bthk,hkd->btd", attn, w["out"],
                     out_sharding=_act(cfg, None, None))
  h = _rms_norm(cfg, x, w["norm2"])
  up = jax.nn.gelu(jnp.einsum("btd,df->btf", h, w["up"],
                              out_sharding=_act(cfg, None, cfg.tensor)))
  return x + jnp.einsum("btf,fd->btd", up, w["down"],
                        out_sharding=_act(cfg, None, None))


def loss_fn(cfg: Config):
  """The mean cross-entropy over a micro-batch's unmasked tokens."""

  def loss(params, microbatch):
    ids = microbatch["ids"]
    x = params["embed"].at[ids].get(out_sharding=_act(cfg, None, None))
    if cfg.pos_broadcast and cfg.batch_axes:
      x = x + jax.lax.broadcast_in_dim(
          params["pos"], x.shape, (1, 2),
          out_sharding=jax.typeof(x).sharding.spec)
    else:
      x = x + params["pos"]  # elementwise: JAX cannot type pos reduced.
    if cfg.scan_layers:
      x, _ = jax.lax.scan(lambda h, w: (_block(cfg, h, w), None), x,
                          params["layers"])
    else:
      for w in params["layers"]:
        x = _block(cfg, x, w)
    x = _rms_norm(cfg, x, params["final_norm"])
    logits = jnp.einsum("btd,dv->btv", x, params["unembed"],
                        out_sharding=_act(cfg, None, None))
    logp = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(
        logp, microbatch["labels"][..., None], axis=-1)[..., 0]
    return -losses.masked_mean(picked, microbatch["mask"])

  return loss


def on_one_device(cfg: Config) -> Config:
  """The same model with no mesh axes: the full-batch reference."""
  return cfg._replace(batch_axes=(), fsdp=None, tensor=None)
