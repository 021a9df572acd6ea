"""Sequences of random lengths: uneven token counts across devices."""

import numpy as np

SEQ, DIM = 8, 16  # tokens per (padded) sequence, features per token.


def make_data(batch_size: int, seed: int) -> dict[str, np.ndarray]:
  """A regression batch; ``mask`` marks each sequence's real tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, SEQ + 1, size=batch_size)
  return {
      "x": rng.normal(size=(batch_size, SEQ, DIM)).astype(np.float32),
      "y": rng.normal(size=(batch_size, SEQ)).astype(np.float32),
      "mask": (np.arange(SEQ) < lengths[:, None]).astype(np.float32),
  }


def num_tokens(batch: dict[str, np.ndarray]):
  """The weight of a (micro-)batch in the mean: its real tokens."""
  return batch["mask"].sum()
