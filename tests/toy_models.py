"""Toy models on padded sequences, shared by the tests (not a test module).

A batch holds ``x`` (rows, seq, dim), targets ``y`` (rows, seq) and a 0/1
``mask`` (rows, seq) whose ones are each row's tokens: rows of different
lengths give micro-batches with different token counts, which is what tells a
token-weighted mean from a mean of micro-batch means. Every model returns
per-token losses, already masked; the tests build their mean and sum losses on
top.
"""

import jax.numpy as jnp
import numpy as np


def padded_batch(rng: np.random.Generator, lengths, seq: int, dim: int):
  """A batch with ``lengths[i]`` tokens in row ``i``, as float32 numpy arrays.

  Draws ``x`` then ``y`` from ``rng``.
  """
  lengths = np.asarray(lengths)
  rows = len(lengths)
  return {
      "x": rng.normal(size=(rows, seq, dim)).astype(np.float32),
      "y": rng.normal(size=(rows, seq)).astype(np.float32),
      "mask": (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32),
  }


def num_tokens(batch):
  """The number of tokens in ``batch``: the sum of its mask."""
  return batch["mask"].sum()


def linear_params(dim: int):
  """Parameters of :func:`linear_token_losses`: a weight vector and a bias."""
  return {"w": jnp.linspace(-1.0, 1.0, dim), "b": jnp.float32(0.3)}


def linear_token_losses(params, batch):
  """Squared error of ``tanh(x @ w + b)``, per token, masked."""
  pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return batch["mask"] * (pred - batch["y"]) ** 2


def mlp_params(dim: int, hidden: int, seed: int):
  """Parameters of :func:`mlp_token_losses`, drawn with ``seed``."""
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(size=(dim, hidden)), jnp.float32),
      "b1": jnp.asarray(rng.normal(size=(hidden,)) * 0.1, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(hidden,)), jnp.float32),
  }


def mlp_token_losses(params, batch):
  """Squared error of a one-hidden-layer tanh network, per token, masked."""
  hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return batch["mask"] * (hidden @ params["w2"] - batch["y"]) ** 2


def safe_mean(token_losses, batch):
  """The mean over the batch's tokens; 0 (not 0/0) without any."""
  return token_losses.sum() / jnp.maximum(num_tokens(batch), 1.0)
