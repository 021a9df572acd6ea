"""Argument checks shared by the public entry points.

Every check runs at construction or trace time and raises with a message that
names the argument, the value that was given and what was expected.
"""

from collections.abc import Callable
import numbers
from typing import Any

import jax
import jax.numpy as jnp

LOSS_REDUCTIONS = ("mean", "sum")


def check_positive_int(name: str, value: Any) -> int:
  """Returns `value` as an int, or raises if it is not a positive integer."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        f"{name} must be a positive int, got {value!r} of type"
        f" {type(value).__name__}."
    )
  if value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}.")
  return int(value)


def check_every_k(value: Any) -> int | Callable[[jax.Array], jax.Array]:
  """Checks `every_k`: a positive int or a callable of the update count."""
  if callable(value):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        "every_k must be a positive int or a callable mapping the update count"
        f" to a cycle length, got {value!r} of type {type(value).__name__}."
    )
  return check_positive_int("every_k", value)


def check_loss_reduction(value: Any) -> str:
  if value not in LOSS_REDUCTIONS:
    raise ValueError(
        f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {value!r}."
    )
  return value


def check_accumulator_dtype(value: Any) -> jnp.dtype:
  try:
    dtype = jnp.dtype(value)
  except TypeError as e:
    raise TypeError(
        f"accumulator_dtype must be a floating dtype, got {value!r}."
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f"accumulator_dtype must be a floating dtype such as jnp.float32, got"
        f" {value!r}."
    )
  return dtype


def check_axis_name(value: Any) -> str | tuple[str, ...] | None:
  """Checks an axis name: None, a hashable name, or a tuple of names."""
  if value is None:
    return None
  if isinstance(value, tuple):
    if not value or not all(isinstance(v, str) for v in value):
      raise TypeError(
          "axis_name must be None, a str or a non-empty tuple of str, got"
          f" {value!r}."
      )
    return value
  if not isinstance(value, str):
    raise TypeError(
        f"axis_name must be None, a str or a tuple of str, got {value!r} of"
        f" type {type(value).__name__}."
    )
  return value


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TypeError(
        f"{name} must be a bool, got {value!r} of type {type(value).__name__}."
    )
  return value


def check_same_structure(
    name: str, tree: Any, expected: Any, expected_name: str
) -> None:
  """Raises if `tree` differs in structure or leaf shapes from `expected`."""
  structure = jax.tree.structure(tree)
  expected_structure = jax.tree.structure(expected)
  if structure != expected_structure:
    raise ValueError(
        f"{name} must have the structure of {expected_name}: expected"
        f" {expected_structure}, got {structure}."
    )
  for path_and_leaf, expected_leaf in zip(
      jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(expected)
  ):
    path, leaf = path_and_leaf
    if jnp.shape(leaf) != jnp.shape(expected_leaf):
      raise ValueError(
          f"{name}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)},"
          f" expected {jnp.shape(expected_leaf)} as in {expected_name}."
      )


def as_token_count(name: str, value: Any) -> jax.Array:
  """Returns a token count as a float32 scalar; None counts as one."""
  if value is None:
    return jnp.ones([], jnp.float32)
  if jnp.ndim(value) != 0:
    raise ValueError(
        f"{name} must be a scalar (the number of items the loss averaged or"
        f" summed over), got an array of shape {jnp.shape(value)}."
    )
  return jnp.asarray(value).astype(jnp.float32)
