"""A two-layer MLP split over the ``model`` axis, Megatron-style.

The first layer is split by columns (each ``model`` device holds half of the
hidden units), the second by rows (each holds the matching half of the output
weights), so the prediction is the sum of the two devices' partial outputs:
one all-reduce over ``model`` on every forward pass, micro-batched or not.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from data import DIM

HIDDEN = 32
PARAM_SPECS = {"w1": P(None, "model"), "w2": P("model")}


def init_params(seed: int) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "w1": jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
      "w2": jax.random.normal(k2, (HIDDEN,)) / np.sqrt(HIDDEN),
  }


def loss_fn(params, batch):
  """Mean squared error over the unmasked tokens of ``batch``."""
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  # Sums over "model" (the model's own collective); out_sharding says where
  # the sum goes, which Explicit axes require: with the batch's rows (over
  # "data" with Explicit axes, where loss_fn sees the global batch; nowhere
  # with Auto ones, where it sees one device's slice).
  rows = jax.typeof(batch["y"]).sharding.spec
  pred = jnp.einsum("bsh,h->bs", hidden, params["w2"],
                    out_sharding=P(*rows) if rows else P())
  errors = batch["mask"] * (pred - batch["y"]) ** 2
  return errors.sum() / batch["mask"].sum()
