"""Verses as byte sequences of uneven lengths, and their token counts."""

import pathlib

import numpy as np

DATA_PATH = pathlib.Path(__file__).parents[1] / "data" / "kjv_verses.txt"
VOCAB_SIZE = 128  # ASCII bytes; the corpus is plain ASCII.
PAD, BOS = 0, 1


def load_batch(
    batch_size: int, seq_len: int, seed: int
) -> dict[str, np.ndarray]:
  """``batch_size`` random verses, each ``BOS verse`` cut to ``seq_len + 1``.

  ``inputs`` are all but the last byte, ``targets`` all but the first, and
  ``mask`` is 1 on the real (unpadded) targets: a short verse counts fewer
  tokens than a long one, so devices and micro-batches hold uneven numbers.
  """
  lines = DATA_PATH.read_text(encoding="ascii").splitlines()
  rng = np.random.default_rng(seed)
  rows = rng.choice(len(lines), size=batch_size, replace=False)
  inputs = np.full((batch_size, seq_len), PAD, np.int32)
  targets = np.full((batch_size, seq_len), PAD, np.int32)
  mask = np.zeros((batch_size, seq_len), np.float32)
  for i, row in enumerate(rows):
    verse = lines[row].split("\t", 1)[1].encode("ascii")
    # A random cut, so that lengths vary widely (1 to seq_len tokens).
    verse = verse[: rng.integers(1, seq_len, endpoint=True)]
    seq = np.frombuffer(bytes([BOS]) + verse, np.uint8)[: seq_len + 1]
    inputs[i, : len(seq) - 1] = seq[:-1]
    targets[i, : len(seq) - 1] = seq[1:]
    mask[i, : len(seq) - 1] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def num_tokens(batch: dict[str, np.ndarray]):
  """The weight of a (micro-)batch in the mean: its real target tokens."""
  return batch["mask"].sum()
