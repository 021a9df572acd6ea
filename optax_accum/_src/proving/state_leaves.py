"""A user's train state as leaves named by path: copied, listed, and the
leaves that are not part of what a step promises.

The checks of this folder run the user's own step on a copy of the state
they are given (a step may donate or, in Flax NNX, change its arguments in
place) and read every leaf of what it returns by its path, as
``jax.tree_util.keystr`` writes it: a path the user can pass back as
``ignore=``. Flax NNX modules and optimizers are pytrees, so they are read
the same way; ``flax.nnx`` is looked up, never imported.
"""

import copy
import sys
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum._src.accumulate import state as state_lib

# Fields of AccumulateState that hold running sums: after an emit they are
# scratch (not part of the contract), and with axis_name each device holds
# its own partial value. Neither k-invariant nor replicated by design.
RUNNING_SUMS = ("grad_sum", "token_count", "stats_sums", "value_sums")
# Fields that depend on k by design: the noise scale's statistics need the
# micro-batches' own norms; the Kahan term of tokens_seen is rounding.
BY_DESIGN = ("stats", "tokens_seen_error")
# Fields kept per device (a slot per device) with axis_name.
PER_DEVICE = ("nonfinite_count", "skipped_count")


class Leaf(NamedTuple):
  """One leaf of a state: its path and value."""

  path: str  # jax.tree_util.keystr of its path.
  value: Any


def _nnx() -> Any:
  return sys.modules.get("flax.nnx")


def _is_graph_node(x: Any) -> bool:
  nnx = _nnx()
  if nnx is None:
    return False
  base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
  return base is not None and isinstance(x, base)


def _copy_leaf(x: Any) -> Any:
  if isinstance(x, jax.Array):  # where it is, committed or not.
    return jax.device_put(x, may_alias=False)
  if isinstance(x, np.ndarray):
    return x.copy()
  return copy.deepcopy(x)


def copied(state: Any) -> Any:
  """A copy of ``state`` whose arrays share no buffer with it.

  A state holding Flax NNX modules or optimizers is split and merged again,
  so that variables shared between them stay shared in the copy.
  """
  graph_nodes = [x for x in jax.tree.leaves(state, is_leaf=_is_graph_node)
                 if _is_graph_node(x)]
  if graph_nodes:
    nnx = _nnx()
    graphdef, values = nnx.split(state)
    return nnx.merge(graphdef, jax.tree.map(_copy_leaf, values))
  return jax.tree.map(_copy_leaf, state)


def leaves(state: Any) -> list[Leaf]:
  """Every leaf of ``state`` with its path, in flattening order."""
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  return [Leaf(jax.tree_util.keystr(path), value) for path, value in flat]


def _is_state(x: Any) -> bool:
  return isinstance(x, state_lib.AccumulateState)


def field_paths(state: Any, fields: tuple[str, ...]) -> list[str]:
  """The paths of the named fields of every AccumulateState in ``state``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_state)
  return [jax.tree_util.keystr(path) + f".{field}"
          for path, node in flat if _is_state(node) for field in fields]


def accumulate_paths(state: Any) -> list[str]:
  """The path of every AccumulateState in ``state``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_state)
  return [jax.tree_util.keystr(path) for path, node in flat
          if _is_state(node)]


def under(path: str, prefixes: list[str] | tuple[str, ...]) -> str | None:
  """The first of ``prefixes`` that names ``path`` or a subtree holding it."""
  for prefix in prefixes:
    if path == prefix or (path.startswith(prefix)
                          and path[len(prefix)] in ".["):
      return prefix
  return None


def check_ignore(ignore: Any, state: Any) -> tuple[str, ...]:
  """``ignore`` as a tuple of paths, each naming at least one leaf."""
  if isinstance(ignore, str):
    ignore = (ignore,)
  try:
    ignore = tuple(ignore)
  except TypeError:
    raise TypeError(
        "ignore must be a sequence of paths as jax.tree_util.keystr writes"
        f" them (e.g. \"['batch_stats']\"), got {ignore!r}.") from None
  if bad := [p for p in ignore if not isinstance(p, str)]:
    raise TypeError(
        "ignore must hold paths as strings (jax.tree_util.keystr of a"
        f" path), got {bad!r}.")
  paths = [leaf.path for leaf in leaves(state)]
  if missing := [p for p in ignore if not any(under(q, [p]) for q in paths)]:
    shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
    raise ValueError(
        f"ignore names {missing}, which name no leaf of state: its paths"
        f" are {shown}.")
  return ignore


def _call_counter_types() -> tuple[type, ...]:
  """Flax's train states whose ``step`` counts calls, where flax is loaded."""
  found = []
  if (nnx := _nnx()) is not None:
    found.append(nnx.Optimizer)
  if (linen_state := sys.modules.get("flax.training.train_state")) is not None:
    found.append(linen_state.TrainState)
  return tuple(found)


def by_design(state: Any) -> dict[str, str]:
  """Leaves that depend on the split by design, each with the reason.

  The running sums of every AccumulateState (scratch after an emit), its
  noise-scale statistics; the ``step`` of an ``nnx.Optimizer`` or a linen
  ``TrainState`` (it counts ``update`` / ``apply_gradients`` calls, which a
  per-call step makes once per micro-batch); Flax NNX random streams (they
  advance once per forward call).
  """
  reasons = dict.fromkeys(
      field_paths(state, RUNNING_SUMS),
      "a running sum of oa.accumulate: scratch after an update")
  reasons.update(
      (path, "depends on the micro-batches by design")
      for path in field_paths(state, BY_DESIGN))
  counters = _call_counter_types()
  is_counter = lambda x: isinstance(x, counters) if counters else False
  flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_counter)
  reasons.update(
      (jax.tree_util.keystr(path) + ".step",
       "counts the calls that update the parameters, once per micro-step")
      for path, node in flat if is_counter(node))
  if (nnx := _nnx()) is not None:
    is_rng = lambda x: isinstance(x, nnx.RngState)
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_rng)
    reasons.update(
        (jax.tree_util.keystr(path),
         "a random stream of Flax NNX: advances once per forward call")
        for path, node in flat if is_rng(node))
  return reasons
