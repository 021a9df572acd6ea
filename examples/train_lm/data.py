"""Verse-completion data: one verse per sequence, padded, with a loss mask.

Each example is one verse of the King James Bible (``examples/data/``), split
at a random point into a prompt and a completion; ``mask`` is 1 exactly on the
completion's targets, as when fine-tuning on (prompt, answer) pairs, so the
tokens that count range from one byte to a whole verse.
"""

from collections.abc import Iterator, Sequence
import pathlib
from typing import Any

import numpy as np

DATA_PATH = pathlib.Path(__file__).parents[1] / "data" / "kjv_verses.txt"
VOCAB_SIZE = 128  # ASCII bytes; the corpus is plain ASCII.
PAD, BOS, EOS = 0, 1, ord("\n")


def load_verses(path: pathlib.Path = DATA_PATH) -> list[bytes]:
  """The verses of the corpus, one ``bytes`` each (the reference is dropped)."""
  lines = path.read_text(encoding="ascii").splitlines()
  return [line.split("\t", 1)[1].encode("ascii") for line in lines]


def split_held_out(verses: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
  """(train, held_out): every 20th verse is held out, never trained on."""
  held_out = list(verses[::20])
  train = [verse for i, verse in enumerate(verses) if i % 20]
  return train, held_out


def encode(
    verses: Sequence[bytes], seq_len: int, seed: int
) -> dict[str, np.ndarray]:
  """Verse-completion arrays for ``verses``, padded to ``seq_len``.

  Sequence ``BOS verse EOS`` is cut to ``seq_len + 1`` bytes; ``inputs`` are all
  but its last byte and ``targets`` all but its first. Each verse is split at a
  random point into a prompt and a completion, and ``mask`` is 1 exactly on the
  completion's targets.
  """
  rng = np.random.default_rng(seed)
  inputs = np.full((len(verses), seq_len), PAD, np.int32)
  targets = np.full((len(verses), seq_len), PAD, np.int32)
  mask = np.zeros((len(verses), seq_len), np.float32)
  for row, verse in enumerate(verses):
    seq = np.frombuffer(bytes([BOS]) + verse + bytes([EOS]), np.uint8)
    seq = seq[: seq_len + 1]
    inputs[row, : len(seq) - 1] = seq[:-1]
    targets[row, : len(seq) - 1] = seq[1:]
    prompt_len = rng.integers(1, len(seq) - 1, endpoint=True)
    mask[row, prompt_len - 1 : len(seq) - 1] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def batches(
    data: dict[str, np.ndarray],
    batch_size: int,
    num_steps: int,
    seed: int,
    group_by_length: bool,
) -> Iterator[dict[str, np.ndarray]]:
  """Yields ``num_steps`` batches, epoch by epoch in a seeded random order.

  With ``group_by_length``, each batch is sorted by token count, as data
  loaders often do to save padding: its first micro-batches then hold a few
  dozen tokens and its last ones several hundred.
  """
  rng = np.random.default_rng(seed)
  num_rows = len(data["inputs"])
  order = np.empty(0, np.int64)
  for _ in range(num_steps):
    if len(order) < batch_size:
      order = np.concatenate([order, rng.permutation(num_rows)])
    rows, order = order[:batch_size], order[batch_size:]
    if group_by_length:
      rows = rows[np.argsort(data["mask"][rows].sum(1), kind="stable")]
    yield {name: array[rows] for name, array in data.items()}


def microbatches(batch: dict[str, Any], k: int) -> list[dict[str, Any]]:
  """Splits ``batch`` into ``k`` consecutive micro-batches of equal size."""
  size = len(batch["inputs"]) // k
  return [
      {name: array[i * size : (i + 1) * size] for name, array in batch.items()}
      for i in range(k)
  ]
