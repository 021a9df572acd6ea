"""Matching one pytree against another, the differences named by path.

:func:`prefix_leaves` spreads a pytree prefix (an argument given per
subtree, like :func:`jax.vmap`'s ``in_axes``) over a tree's leaves;
:func:`first_difference` says where two trees' structures differ. Both
name the paths one tree has and the other lacks, not two PyTreeDefs: those
of a model's state run to thousands of characters.
"""

from typing import Any

import jax

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
