"""Cross-device reductions: partial sums stay local until summed once."""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp


def sum_partials(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
  """Sums per-device partial sums (with a leading slot axis) over an axis."""
  return jax.tree.map(
      lambda x: lax.psum(x.reshape(x.shape[1:]), axis_name), tree
  )


def zeros_like_partials(tree: Any) -> Any:
  """Zeros shaped and typed like ``tree``, varying over the same axes."""

  def zeros_like(x):
    zeros = jnp.zeros(x.shape, x.dtype)
    vma = getattr(jax.typeof(x), "vma", frozenset())
    return lax.pcast(zeros, tuple(sorted(vma)), to="varying") if vma else zeros

  return jax.tree.map(zeros_like, tree)


def _vma(x: Any) -> frozenset[str]:
  return getattr(jax.typeof(x), "vma", frozenset())


def _axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def to_varying(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
  """Marks each leaf as varying over ``axis_name`` (a no-op where it is).

  Inside :func:`jax.shard_map`, the gradient of a value that is invariant over
  an axis is summed over that axis by autodiff. Taking the gradient with
  respect to a varying copy keeps it local to the device instead.
  """
  axes = _axes(axis_name)

  def cast(x):
    missing = tuple(a for a in axes if a not in _vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def psum_once(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
  """Sums every leaf over ``axis_name``: the one reduction of a step."""
  return lax.psum(tree, axis_name)
