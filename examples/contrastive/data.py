"""Two augmented views of each 8x8 handwritten digit.

The digits (``examples/data/digits.npz``: 1797 images of 8x8 pixels, 0 to 16)
are split once into training images and held-out images. A training batch
holds ``batch_size`` training images, each seen twice through a random
augmentation (a shift of up to one pixel in each direction, and noise): view
``a`` and view ``b``. The model must tell, for every ``a``, which ``b`` in the
batch shows the same image: the other rows are its negatives.
"""

from collections.abc import Iterator
import pathlib

import numpy as np

DATA_PATH = pathlib.Path(__file__).parents[1] / "data" / "digits.npz"
SIDE = 8


def load_digits(path: pathlib.Path = DATA_PATH) -> np.ndarray:
  """The images as float32 in [0, 1], shape (1797, 8, 8)."""
  with np.load(path) as digits:
    return digits["images"].astype(np.float32) / 16.0


def split_held_out(images: np.ndarray, held_out: int, seed: int = 0):
  """(train, held_out) images: a fixed random ``held_out`` are set aside."""
  order = np.random.default_rng(seed).permutation(len(images))
  return images[order[held_out:]], images[order[:held_out]]


NOISE = 0.05  # standard deviation of the noise added to a view.


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """One random view of each image, flattened to 64 features."""
  n = len(images)
  padded = np.pad(images, ((0, 0), (1, 1), (1, 1)))
  dy, dx = rng.integers(0, 3, size=(2, n))
  rows = dy[:, None] + np.arange(SIDE)[None, :]
  cols = dx[:, None] + np.arange(SIDE)[None, :]
  shifted = padded[np.arange(n)[:, None, None], rows[:, :, None],
                   cols[:, None, :]]
  noise = NOISE * rng.standard_normal(shifted.shape)
  return (shifted + noise).reshape(n, SIDE * SIDE).astype(np.float32)


def two_views(images: np.ndarray, seed: int) -> dict[str, np.ndarray]:
  """``{'a': view, 'b': another view}`` of every image, reproducibly."""
  rng = np.random.default_rng(seed)
  return {"a": augment(images, rng), "b": augment(images, rng)}


def batches(images: np.ndarray, batch_size: int, num_steps: int,
            seed: int) -> Iterator[dict[str, np.ndarray]]:
  """``num_steps`` batches of two views of ``batch_size`` distinct images."""
  rng = np.random.default_rng(seed)
  for _ in range(num_steps):
    chosen = images[rng.choice(len(images), batch_size, replace=False)]
    yield {"a": augment(chosen, rng), "b": augment(chosen, rng)}
