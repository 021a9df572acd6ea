"""Argument checks shared by the public entry points.

Every check runs at construction or trace time and raises with a message that
names the argument, the value that was given and what was expected.
"""

from collections.abc import Callable
import difflib
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_accum._src import caller_warnings
from optax_accum._src import flax_nnx
from optax_accum._src import tree_match

LOSS_REDUCTIONS = ("mean", "sum")
INT32_MAX = 2**31 - 1


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


def check_every_k(
    value: Any,
) -> int | Callable[[jax.Array], jax.Array] | None:
  """Checks `every_k`: a positive int, a callable of the update count, None.

  None: no cycle ends by count, only where ``emit`` says.
  """
  if value is None or callable(value):
    return value
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(
        "every_k must be a positive int, a callable mapping the update count"
        " to a cycle length, or None (cycles end only on emit=True), got"
        f" {value!r} of type {type(value).__name__}."
    )
  every_k = check_positive_int("every_k", value)
  if every_k > INT32_MAX:
    raise ValueError(
        f"every_k must fit in int32 (at most {INT32_MAX}), got {every_k}."
    )
  return every_k


def check_loss_reduction(value: Any) -> str:
  if value not in LOSS_REDUCTIONS:
    raise ValueError(
        f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {value!r}."
    )
  return value


def _floating_dtype(where: str, value: Any) -> jnp.dtype:
  """``value`` as a floating dtype; ``where`` names it in the error."""
  try:
    dtype = None if value is None else jnp.dtype(value)
  except TypeError as e:
    raise TypeError(f"{where} must be a floating dtype, got {value!r}.") from e
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    shown = repr(value) if dtype is None else dtype.name
    raise ValueError(
        f"{where} must be a floating dtype such as jnp.float32, got {shown}."
    )
  return dtype


def check_accumulator_dtype(value: Any) -> jnp.dtype:
  return _floating_dtype("accumulator_dtype", value)


def _is_dtype_leaf(x: Any) -> bool:
  """A dtype-like leaf: a dtype, a scalar type, or its name."""
  return x is None or isinstance(x, (str, jnp.dtype, type))


def check_accumulator_dtypes(value: Any) -> Any:
  """Checks ``accumulator_dtype``: None, a floating dtype, or a pytree of them.

  None (the default, also as a leaf of a tree) stands for :func:`wider_dtype`
  of each parameter. A tree is a pytree prefix of the parameters (checked
  against them at ``init`` or trace time, by :func:`per_leaf_dtypes`).
  Returns None, the dtype, or the tree with each leaf a :class:`jnp.dtype`
  or None.
  """
  if value is None:
    return None
  if _is_dtype_leaf(value):
    dtype = check_accumulator_dtype(value)
    _warn_if_narrow([("", dtype)])
    return dtype
  leaves = jax.tree_util.tree_flatten_with_path(value,
                                                is_leaf=_is_dtype_leaf)[0]
  if not leaves:
    raise ValueError(
        "accumulator_dtype must be a floating dtype or a pytree prefix of"
        f" the parameters with floating dtypes as leaves, got {value!r}."
    )
  checked = [(jax.tree_util.keystr(path),
              _floating_dtype(f"accumulator_dtype{jax.tree_util.keystr(path)}",
                              leaf))
             for path, leaf in leaves if leaf is not None]
  _warn_if_narrow(checked)
  return jax.tree.map(lambda x: None if x is None else jnp.dtype(x), value,
                      is_leaf=_is_dtype_leaf)


def _warn_if_narrow(dtypes: list[tuple[str, jnp.dtype]]) -> None:
  """Warns of an explicit running sum narrower than float32 (the classic
  bf16 accumulator: once the sum is large, small gradients round away)."""
  narrow = [f"accumulator_dtype{path}={dtype.name}" for path, dtype in dtypes
            if jnp.finfo(dtype).bits < 32]
  if narrow:
    caller_warnings.warn(
        f"{', '.join(narrow)} keeps the running sum narrower than float32:"
        " once the sum is large, small gradients round away (1000"
        " gradients of 1.0 summed in bfloat16 make 256, not 1000). Leave"
        " accumulator_dtype out (float32, or the parameter's dtype where"
        " wider) unless memory forces it.")


def wider_dtype(x: Any) -> jnp.dtype:
  """The default running sum's dtype for a value like ``x``: the wider of
  float32 and ``x``'s floating dtype (float32 for bfloat16, float16 and
  integers; float64 stays float64 under ``jax_enable_x64``)."""
  dtype = getattr(x, "dtype", None)
  dtype = jnp.result_type(x) if dtype is None else jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return jnp.dtype(jnp.float32)
  # By size, not jnp.promote_types: strict dtype promotion refuses that.
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype if dtype.itemsize >= 16 else jnp.dtype(jnp.complex64)
  return dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)


def scalar_sum_dtype(accumulator_dtype: Any, params: Any = None) -> jnp.dtype:
  """The dtype of the loss's and aux's running sums.

  A single ``accumulator_dtype`` is theirs too. By default (None) and with
  one per leaf (a tree), the wider of float32 and the widest floating
  parameter: float64 under ``jax_enable_x64`` with float64 parameters.
  """
  if isinstance(accumulator_dtype, jnp.dtype):
    return accumulator_dtype
  widest = jnp.dtype(jnp.float32)
  for leaf in jax.tree.leaves(params):
    dtype = wider_dtype(leaf)
    if jnp.issubdtype(dtype, jnp.floating) and (
        dtype.itemsize > widest.itemsize):
      widest = dtype
  return widest


def per_leaf_dtypes(accumulator_dtype: Any, params: Any) -> Any:
  """``accumulator_dtype`` spread over ``params``: a tree of dtypes like it
  (:func:`wider_dtype` of a parameter where it is None)."""
  if isinstance(accumulator_dtype, jnp.dtype):
    return jax.tree.map(lambda _: accumulator_dtype, params)
  if accumulator_dtype is None:
    return jax.tree.map(wider_dtype, params)
  dtypes = tree_match.prefix_leaves("accumulator_dtype", accumulator_dtype,
                                    params, "the parameters",
                                    is_leaf=_is_dtype_leaf)
  return jax.tree.unflatten(
      jax.tree.structure(params),
      [wider_dtype(p) if d is None else d
       for d, p in zip(dtypes, jax.tree.leaves(params))])


def check_axis_name(value: Any, name: str = "axis_name"
                    ) -> str | tuple[str, ...] | None:
  """Checks an axis name: None, a name, or a tuple of names; ``name`` is
  the argument's, for the error."""
  if value is None:
    return None
  if isinstance(value, tuple):
    if not value or not all(isinstance(v, str) for v in value):
      raise TypeError(
          f"{name} must be None, a str or a non-empty tuple of str, got"
          f" {value!r}."
      )
    return value
  if not isinstance(value, str):
    raise TypeError(
        f"{name} must be None, a str or a tuple of str, got {value!r} of"
        f" type {type(value).__name__}."
    )
  return value


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TypeError(
        f"{name} must be a bool, got {value!r} of type {type(value).__name__}."
    )
  return value


def check_mesh(value: Any, name: str = "mesh") -> Any:
  """None, or a ``jax.sharding.Mesh`` or ``AbstractMesh``."""
  if value is not None and not isinstance(
      value, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(
        f"{name} must be a jax.sharding.Mesh (or AbstractMesh) or None, got"
        f" {value!r} of type {type(value).__name__}.")
  return value


def check_same_structure(
    name: str, tree: Any, expected: Any, expected_name: str
) -> None:
  """Raises if `tree` differs in structure or leaf shapes from `expected`."""
  if jax.tree.structure(tree) != jax.tree.structure(expected):
    raise ValueError(
        f"{name} must have the structure of {expected_name}:"
        f" {tree_match.first_difference(tree, expected, expected_name)}."
        + flax_nnx.structure_hint(name, tree, expected, expected_name)
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


def _is_concrete(value: Any) -> bool:
  return not isinstance(value, jax.core.Tracer)


def as_token_count(name: str, value: Any) -> jax.Array:
  """Returns a token count as a float32 scalar.

  (A missing count is ``token_weighting.MissingCount``'s.) A concrete count
  that is not a finite non-negative number raises here; a traced one is
  checked by the token-weighting rules (see ``token_weighting``).
  """
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
  else:
    is_real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(
        dtype, jnp.floating
    )
  if not is_real:
    raise TypeError(
        f"{name} must be a real number (the count of items the loss averaged"
        f" or summed over), got {value!r} of type {type(value).__name__}."
    )
  if jnp.ndim(value) != 0:
    raise ValueError(
        f"{name} must be a scalar (the number of items the loss averaged or"
        f" summed over), got an array of shape {jnp.shape(value)}."
    )
  if _is_concrete(value):
    number = float(value)  # Python ints of any size, Fraction.
    if not math.isfinite(number) or number < 0:
      raise ValueError(
          f"{name} must be a finite number >= 0, got {value!r}."
      )
    return jnp.asarray(number, jnp.float32)
  return jnp.asarray(value).astype(jnp.float32)


def check_predicate(name: str, value: Any) -> jax.Array:
  """Returns ``value`` as a bool scalar, or raises naming ``name``."""
  if isinstance(value, (bool, np.bool_)):
    return jnp.asarray(value)
  dtype = getattr(value, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.bool_) or jnp.ndim(value):
    shape = "" if dtype is None else f" {dtype}{list(jnp.shape(value))}"
    raise TypeError(
        f"{name} must be a bool scalar, got {type(value).__name__}{shape}."
    )
  return jnp.asarray(value)


def check_optional_callable(name: str, value: Any) -> Callable[..., Any] | None:
  if value is not None and not callable(value):
    raise TypeError(f"{name} must be None or callable, got {value!r}.")
  return value


def check_transformation(name: str, value: Any) -> None:
  if not isinstance(value, optax.GradientTransformation):
    raise TypeError(
        f"{name} must be an optax.GradientTransformation, got"
        f" {type(value).__name__}."
    )


def refuse_extra_args(name: str, extra_args: dict[str, Any]) -> None:
  """Raises for keyword arguments that a plain transformation cannot take."""
  raise TypeError(
      f"Unexpected keyword argument(s) {sorted(extra_args)} to update: {name}"
      " is a plain optax.GradientTransformation, which takes no extra"
      " arguments, so they would be silently ignored (a typo of num_tokens"
      " or emit?)."
  )


def refuse_near_misses(extra_args: dict[str, Any],
                       own: tuple[str, ...], call: str = "update",
                       goes_to: str = "the inner optimizer",
                       accepted: Any = ()) -> None:
  """Raises for keyword arguments that look like a typo of one of ``own``.

  ``call`` took them and would pass them on to ``goes_to``; names in
  ``accepted`` (those ``goes_to`` declares) are never typos.
  """
  for key in extra_args:
    close = difflib.get_close_matches(key, own, n=1, cutoff=0.75)
    if close and key not in accepted:
      raise TypeError(
          f"Unexpected keyword argument {key!r} to {call}: did you mean"
          f" {close[0]!r}? It would go on to {goes_to}, which could"
          " silently ignore it."
      )


def check_param_leaves(params: Any) -> None:
  """``tx.init``'s params must be arrays (or numbers): not a whole module.

  A whole Equinox module holds functions and other static leaves, which
  optax's ``init`` would fail on deep inside ``jnp.zeros_like``.
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not (isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float,
                              complex, bool))
            or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))):
      raise TypeError(
          f"params{jax.tree_util.keystr(path)} is a {type(leaf).__name__},"
          " not an array: tx.init(params) takes the parameters alone. For an"
          " Equinox model, init on eqx.filter(model, eqx.is_inexact_array)"
          " (the arrays to train); the static part stays out of the"
          " optimizer."
      )
