"""``tree_match``: a prefix spread over a tree, and differences by path.

The messages name the paths one tree has and the other lacks (at most three,
then a count), not two PyTreeDefs; the public entry points' messages built
on them are checked in ``test_validation.py``.
"""

import jax.numpy as jnp
import pytest

from optax_accum._src import tree_match

TREE = {"a": jnp.zeros(2), "b": {"c": jnp.zeros(3), "d": jnp.zeros(())}}


def test_a_prefix_entry_stands_for_its_whole_subtree():
  assert tree_match.prefix_leaves("x", 7, TREE, "the tree") == [7, 7, 7]
  assert tree_match.prefix_leaves(
      "x", {"a": 1, "b": 2}, TREE, "the tree") == [1, 2, 2]
  # None is an entry too, not an empty subtree.
  assert tree_match.prefix_leaves(
      "x", {"a": None, "b": {"c": 3, "d": None}}, TREE, "the tree") == [
          None, 3, None]


def test_is_leaf_marks_further_entries_of_the_prefix():
  is_pair = lambda x: isinstance(x, tuple)
  assert tree_match.prefix_leaves(
      "x", {"a": (1, 2), "b": (3, 4)}, TREE, "the tree",
      is_leaf=is_pair) == [(1, 2), (3, 4), (3, 4)]


def test_a_prefix_that_does_not_fit_names_the_name_and_the_paths():
  with pytest.raises(ValueError, match=(
      r"^x must be a single value or a pytree prefix of the tree; .*its"
      r" entries at \['e'\] match no leaf; it has no entry for"
      r" \['b'\]\['c'\], \['b'\]\['d'\]\.$")):
    tree_match.prefix_leaves("x", {"a": 1, "e": 2}, TREE, "the tree")


def test_a_long_prefix_mismatch_leaves_out_the_treedefs():
  wide = {f"k{i:03}": jnp.zeros(()) for i in range(40)}
  with pytest.raises(ValueError) as error:
    tree_match.prefix_leaves("x", {"k000": 1}, wide, "the tree")
  message = str(error.value)
  assert "structured as" not in message, message
  assert message.endswith(
      "it has no entry for ['k001'], ['k002'], ['k003'] and 36 more."), message


def test_first_difference_names_what_each_tree_lacks():
  fewer = {"a": jnp.zeros(2), "b": {"c": jnp.zeros(3)}}
  more = {**TREE, "e": jnp.zeros(1)}
  assert tree_match.first_difference(fewer, TREE, "params") == (
      "it lacks ['b']['d']")
  assert tree_match.first_difference(more, TREE, "params") == (
      "it has ['e'], not in params")


def test_containers_that_differ_are_named_by_type_when_long():
  """Same paths, another container: the PyTreeDefs where they are short."""
  short = tree_match.first_difference([1, 2], (1, 2), "params")
  assert short == "expected PyTreeDef((*, *)), got PyTreeDef([*, *])"
  long = tree_match.first_difference([0] * 100, (0,) * 100, "params")
  assert long == ("its leaves are at the same paths but its containers"
                  " differ (a list, expected a tuple)")
