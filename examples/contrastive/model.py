"""A small MLP encoder shared by both views, and the InfoNCE loss.

The encoder maps a view to a unit-norm embedding. The loss is symmetric
InfoNCE (CLIP, SimCLR): the logits are the scaled cosine similarities of every
view ``a`` with every view ``b`` of the batch, the matching pair is the right
answer and every other row of the batch is a negative. Its temperature is
learned. The loss couples the whole batch, so it is not a sum over examples.
"""

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


def init_params(seed: int, sizes: tuple[int, ...]) -> Params:
  """Glorot-uniform layers ``sizes[0] -> ... -> sizes[-1]``, temperature 0.1."""
  rng = np.random.default_rng(seed)
  layers = []
  for fan_in, fan_out in itertools.pairwise(sizes):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    layers.append({
        "w": jnp.asarray(rng.uniform(-limit, limit, (fan_in, fan_out)),
                         jnp.float32),
        "b": jnp.zeros(fan_out, jnp.float32)})
  return {"layers": layers, "log_scale": jnp.log(jnp.float32(10.0))}


def embed(params: Params, x: jax.Array) -> jax.Array:
  """Unit-norm embeddings of flattened views, shape (batch, sizes[-1])."""
  *hidden, last = params["layers"]
  for layer in hidden:
    x = jax.nn.gelu(x @ layer["w"] + layer["b"])
  x = x @ last["w"] + last["b"]
  return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def encode(params: Params, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The representations of a (micro-)batch: both views' embeddings."""
  return {"a": embed(params, batch["a"]), "b": embed(params, batch["b"])}


def info_nce(params: Params, reps: dict[str, jax.Array],
             batch: Any) -> jax.Array:
  """Symmetric InfoNCE over the rows of ``reps``: in-batch negatives."""
  del batch  # everything the loss needs is in reps.
  scale = jnp.exp(jnp.minimum(params["log_scale"], jnp.log(100.0)))
  logits = scale * reps["a"] @ reps["b"].T
  a_to_b = -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=1)))
  b_to_a = -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, axis=0)))
  return (a_to_b + b_to_a) / 2


def loss(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
  """InfoNCE of a batch, negatives from that batch only."""
  return info_nce(params, encode(params, batch), batch)


def retrieval_accuracy(params: Params,
                       views: dict[str, jax.Array]) -> jax.Array:
  """Top-1 retrieval: how often view ``a``'s nearest ``b`` is its own image."""
  reps = encode(params, views)
  nearest = jnp.argmax(reps["a"] @ reps["b"].T, axis=1)
  return jnp.mean(nearest == jnp.arange(len(nearest)))
