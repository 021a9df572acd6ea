"""Argument checks shared by the public entry points.

Every check runs at construction or trace time and raises with a message that
names the argument, the value that was given and what was expected.
"""

from collections.abc import Callable
import difflib
import math
import numbers
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
    return check_accumulator_dtype(value)
  leaves = jax.tree_util.tree_flatten_with_path(value,
                                                is_leaf=_is_dtype_leaf)[0]
  if not leaves:
    raise ValueError(
        "accumulator_dtype must be a floating dtype or a pytree prefix of"
        f" the parameters with floating dtypes as leaves, got {value!r}."
    )
  for path, leaf in leaves:
    if leaf is not None:
      _floating_dtype(f"accumulator_dtype{jax.tree_util.keystr(path)}", leaf)
  return jax.tree.map(lambda x: None if x is None else jnp.dtype(x), value,
                      is_leaf=_is_dtype_leaf)


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
  dtypes = prefix_leaves("accumulator_dtype", accumulator_dtype, params,
                         "the parameters", is_leaf=_is_dtype_leaf)
  return jax.tree.unflatten(
      jax.tree.structure(params),
      [wider_dtype(p) if d is None else d
       for d, p in zip(dtypes, jax.tree.leaves(params))])


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


def check_mesh(value: Any, name: str = "mesh") -> Any:
  """None, or a ``jax.sharding.Mesh`` or ``AbstractMesh``."""
  if value is not None and not isinstance(
      value, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(
        f"{name} must be a jax.sharding.Mesh (or AbstractMesh) or None, got"
        f" {value!r} of type {type(value).__name__}.")
  return value


_SHORT = 200  # characters: a PyTreeDef longer than this is not shown.


def _paths(paths: list) -> str:
  shown = ", ".join(jax.tree_util.keystr(p) for p in paths[:3])
  return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def first_difference(tree: Any, expected: Any, expected_name: str,
                     is_leaf=None) -> str:
  """Where ``tree``'s structure differs from ``expected``'s, in words.

  Names the paths that one has and the other lacks, not two PyTreeDefs:
  those of a model's state run to thousands of characters.
  """
  def paths_of(t):
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(
        t, is_leaf=is_leaf)[0]]

  got, want = paths_of(tree), paths_of(expected)
  got_set, want_set = set(got), set(want)
  missing = [p for p in want if p not in got_set]
  extra = [p for p in got if p not in want_set]
  parts = []
  if missing:
    parts.append(f"it lacks {_paths(missing)}")
  if extra:
    parts.append(f"it has {_paths(extra)}, not in {expected_name}")
  if not parts:
    got_def = str(jax.tree.structure(tree, is_leaf=is_leaf))
    want_def = str(jax.tree.structure(expected, is_leaf=is_leaf))
    if len(got_def) + len(want_def) <= _SHORT:
      return f"expected {want_def}, got {got_def}"
    return (f"its leaves are at the same paths but its containers differ"
            f" (a {type(tree).__name__}, expected a"
            f" {type(expected).__name__})")
  return "; ".join(parts)


def check_same_structure(
    name: str, tree: Any, expected: Any, expected_name: str
) -> None:
  """Raises if `tree` differs in structure or leaf shapes from `expected`."""
  if jax.tree.structure(tree) != jax.tree.structure(expected):
    raise ValueError(
        f"{name} must have the structure of {expected_name}:"
        f" {first_difference(tree, expected, expected_name)}."
        + _nnx_structure_hint(name, tree, expected, expected_name)
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


def _mismatch(prefix: Any, tree: Any, is_leaf) -> str:
  """Where ``prefix`` stops being a prefix of ``tree``, in words.

  Its entries that match no leaf of ``tree`` (a misspelt key), and the
  leaves of ``tree`` that no entry covers (a key left out).
  """
  tree_paths = [path for path, _ in
                jax.tree_util.tree_flatten_with_path(tree)[0]]
  prefix_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=is_leaf)[0]]
  extra = [q for q in prefix_paths
           if not any(p[:len(q)] == q for p in tree_paths)]
  missing = [p for p in tree_paths
             if not any(p[:len(q)] == q for q in prefix_paths)]
  parts = []
  if extra:
    parts.append(f"its entries at {_paths(extra)} match no leaf")
  if missing:
    parts.append(f"it has no entry for {_paths(missing)}")
  return "; ".join(parts)


def prefix_leaves(name: str, prefix: Any, tree: Any, tree_name: str,
                  is_leaf=None) -> list:
  """The entry of ``prefix`` that covers each leaf of ``tree``, in order.

  ``prefix`` is a pytree prefix of ``tree`` (like :func:`jax.vmap`'s
  ``in_axes``) whose leaves, None included, each stand for a whole subtree.
  ``is_leaf`` marks further leaves of ``prefix``.
  """
  def prefix_leaf(x):
    return x is None or (is_leaf is not None and is_leaf(x))

  entries, prefix_def = jax.tree.flatten(prefix, is_leaf=prefix_leaf)
  try:
    subtrees = prefix_def.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    structures = (f"got {name} structured as {prefix_def}, {tree_name} as"
                  f" {jax.tree.structure(tree)}")
    where = _mismatch(prefix, tree, prefix_leaf)
    short = structures if len(structures) <= _SHORT else ""
    detail = "; ".join(x for x in (short, where) if x)
    raise ValueError(
        f"{name} must be a single value or a pytree prefix of {tree_name};"
        f" {detail or structures[:_SHORT] + '...'}."
    ) from e
  return [
      entry
      for entry, subtree in zip(entries, subtrees)
      for _ in jax.tree.leaves(subtree)
  ]


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


def _flax_nnx() -> Any:
  """``flax.nnx`` if it is loaded, else None.

  Looked up, not imported: where nothing has loaded it, no tree holds its
  types, and optax_accum does not need flax.
  """
  return sys.modules.get("flax.nnx")


def _holds_variables(nnx: Any, tree: Any) -> bool:
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return any(map(is_variable, jax.tree.leaves(tree, is_leaf=is_variable)))


def _nnx_structure_hint(name: str, tree: Any, expected: Any,
                       expected_name: str) -> str:
  """Why an NNX ``tree`` differs from ``expected``, and the fix ("" if not).

  ``nnx.Optimizer.update`` hands the transformation
  ``nnx.as_pure(nnx.state(grads, wrt))``: only the gradients that are
  Variables of its ``wrt`` filter, so plain arrays
  (``nnx.as_pure(grads)``) arrive as a State without them.
  """
  nnx = _flax_nnx()
  if nnx is None:
    return ""
  has_variables = _holds_variables(nnx, tree)
  expects_variables = _holds_variables(nnx, expected)
  if has_variables and not expects_variables:
    return (
        f" {name} holds nnx.Variables, {expected_name} plain arrays: pass"
        f" nnx.as_pure({name}), or build the state from the same kind of"
        " tree."
    )
  if expects_variables and not has_variables:
    return (
        f" {name} holds plain arrays, {expected_name} nnx.Variables: build"
        " the state from plain arrays,"
        " tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))."
    )
  got, want = len(jax.tree.leaves(tree)), len(jax.tree.leaves(expected))
  if not isinstance(tree, nnx.State) or got >= want:
    return ""
  return (
      f" {name} arrived as an nnx.State with {got} of the {want} expected"
      " arrays: nnx.Optimizer.update passes on only the gradients that are"
      " nnx.Variables of its wrt filter (nnx.state(grads, wrt)), so plain"
      " arrays, such as nnx.as_pure(grads) gives, are dropped before they"
      " reach the transformation. Pass grads as nnx.grad returned them:"
      " optimizer.update(model, grads, num_tokens=...)."
  )


def _variable_sharding(variable: Any) -> Any:
  """The sharding that flax gives an optimizer state built from ``variable``.

  ``nnx.Optimizer`` copies each Variable's metadata onto its state's leaf,
  ``optimizer_sharding`` in place of ``out_sharding`` where given (older
  flax: ``sharding_names``, ``sharding``).
  """
  metadata = variable.get_metadata()
  for key in ("optimizer_sharding", "out_sharding", "sharding_names",
              "sharding"):
    if metadata.get(key) is not None:
      return metadata[key]
  return None


def _names_an_axis(sharding: Any) -> bool:
  spec = getattr(sharding, "spec", sharding)  # a NamedSharding's spec.
  if isinstance(spec, (tuple, list)):
    return any(entry is not None for entry in spec)
  return bool(spec)


def check_slots_fit_params(axis_name: Any, params: Any) -> None:
  """``tx.init``: refuses ``axis_name`` for params of sharded nnx Variables.

  With ``axis_name`` each running sum has a leading slot axis (a partial sum
  per device). ``nnx.Optimizer`` gives each state leaf built from a Variable
  that Variable's sharding, which then names the slot axis: flax fails
  ("Sharding spec ... does not evenly divide"), or shards the slots over the
  wrong axis when the sizes happen to divide.
  """
  nnx = _flax_nnx()
  if axis_name is None or nnx is None:
    return
  is_variable = lambda x: isinstance(x, nnx.Variable)
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      params, is_leaf=is_variable):
    if not is_variable(leaf):
      continue
    sharding = _variable_sharding(leaf)
    if sharding is None or not _names_an_axis(sharding):
      continue
    raise ValueError(
        f"accumulate(axis_name={axis_name!r}) keeps its running sums with a"
        " leading slot axis (a partial sum per device), but"
        f" params{jax.tree_util.keystr(path)} is an nnx.Variable sharded"
        f" {sharding!r}, and nnx.Optimizer gives the state that sharding,"
        " which would land on the slot axis. Under jax.jit leave axis_name"
        " out: oa.accumulate(inner, every_k=...) reads the data axes off the"
        " gradients' types (unreduced gradients carry their axes), as"
        " docs/distributed.md says. axis_name is for tx.update inside"
        " jax.shard_map or jax.pmap, on a state built from plain arrays:"
        " tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))."
    )
