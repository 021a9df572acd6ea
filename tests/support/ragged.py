"""A tiny model and batches of uneven lengths, some micro-batches empty.

Shared by the tests of how the loop drops a micro-batch without tokens
(``test_borrowing.py``, ``test_empty_safe.py``): its mean loss is 0/0 on
purpose, and its gradient goes through a gather (an embedding).
"""

import jax.numpy as jnp
import numpy as np

import helpers

SEQ, DIM, VOCAB = 5, 4, 11


def batch(lengths, seed=0):
  """One row per length, its first ``length`` tokens unmasked."""
  rng = np.random.default_rng(seed)
  rows = len(lengths)
  return {
      "ids": jnp.asarray(rng.integers(0, VOCAB, (rows, SEQ)), jnp.int32),
      "y": jnp.asarray(rng.normal(size=(rows, SEQ)), jnp.float32),
      "mask": jnp.asarray(np.arange(SEQ)[None] < np.asarray(lengths)[:, None],
                          jnp.float32),
  }


def params():
  return {"embed": jnp.linspace(-1.0, 1.0, VOCAB * DIM).reshape(VOCAB, DIM),
          "w": jnp.linspace(0.5, -0.5, DIM)}


def token_losses(params, batch):
  h = jnp.tanh(params["embed"][batch["ids"]] @ params["w"])  # a gather.
  return batch["mask"] * (h - batch["y"]) ** 2


def mean_loss(params, batch):  # 0/0 without tokens, on purpose.
  return token_losses(params, batch).sum() / helpers.num_tokens(batch)
