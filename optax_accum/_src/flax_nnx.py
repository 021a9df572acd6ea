"""What we know of Flax NNX's trees: their Variables, and two mistakes they
allow, named.

optax_accum does not need flax, so nothing here imports it: ``flax.nnx`` is
looked up among the loaded modules, and where nothing has loaded it no tree
holds its types and every check here passes. The mistakes:

* gradients that ``nnx.Optimizer.update`` drops before they reach the
  transformation (plain arrays fail its ``wrt`` filter), or a tree of
  Variables against a state of plain arrays (:func:`structure_hint`, which
  ``validation.check_same_structure`` adds to its message);
* ``accumulate(axis_name=...)`` on parameters of sharded Variables, whose
  sharding ``nnx.Optimizer`` would give the state's slot axis
  (:func:`check_slots_fit_params`, at ``tx.init``).

And :func:`unwrap_variables`: an ``nnx.Optimizer``'s state read as arrays;
:func:`optimizer_sharding_axes`: the mesh axes each Variable's
``optimizer_sharding`` names (ZeRO's, where the parameter is replicated).
"""

import sys
from typing import Any

import jax


def _loaded_nnx() -> Any:
  """``flax.nnx`` if it is loaded, else None.

  Looked up, not imported: where nothing has loaded it, no tree holds its
  types, and optax_accum does not need flax.
  """
  return sys.modules.get("flax.nnx")


def _holds_variables(nnx: Any, tree: Any) -> bool:
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return any(map(is_variable, jax.tree.leaves(tree, is_leaf=is_variable)))


def structure_hint(name: str, tree: Any, expected: Any,
                   expected_name: str) -> str:
  """Why an NNX ``tree`` differs from ``expected``, and the fix ("" if not).

  ``nnx.Optimizer.update`` hands the transformation
  ``nnx.as_pure(nnx.state(grads, wrt))``: only the gradients that are
  Variables of its ``wrt`` filter, so plain arrays
  (``nnx.as_pure(grads)``) arrive as a State without them.
  """
  nnx = _loaded_nnx()
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
  # Through _spec_axes: a PartitionSpec is no tuple in every jax, and
  # P(None, None) is true, though it names no axis.
  return bool(_spec_axes(sharding))


def check_slots_fit_params(axis_name: Any, params: Any) -> None:
  """``tx.init``: refuses ``axis_name`` for params of sharded nnx Variables.

  With ``axis_name`` each running sum has a leading slot axis (a partial sum
  per device). ``nnx.Optimizer`` gives each state leaf built from a Variable
  that Variable's sharding, which then names the slot axis: flax fails
  ("Sharding spec ... does not evenly divide"), or shards the slots over the
  wrong axis when the sizes happen to divide.
  """
  nnx = _loaded_nnx()
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


def _spec_axes(sharding: Any) -> tuple[str, ...]:
  """The mesh axes a spec (a PartitionSpec, a tuple of names, a
  NamedSharding) names, in order."""
  spec = getattr(sharding, "spec", sharding)
  if isinstance(spec, jax.sharding.PartitionSpec):
    entries = getattr(spec, "partitions", None) or getattr(
        spec, "_partitions", ())  # jax 0.9: _partitions only.
  else:
    entries = spec if isinstance(spec, (tuple, list)) else (spec,)
  return tuple(name for entry in entries if entry is not None
               for name in (entry if isinstance(entry, (tuple, list))
                            else (entry,)))


def optimizer_sharding_axes(params: Any) -> list[tuple[str, ...]]:
  """Per array leaf of ``params``, the mesh axes that its Variable's
  ``optimizer_sharding`` names (``()`` for a plain array, or a Variable
  without one).

  ``nnx.Optimizer`` lays out each state leaf built from such a Variable
  over those axes: with the parameter replicated over them, ZeRO.
  """
  nnx = _loaded_nnx()
  if nnx is None:
    return [() for _ in jax.tree.leaves(params)]
  is_variable = lambda x: isinstance(x, nnx.Variable)
  axes = []
  for leaf in jax.tree.leaves(params, is_leaf=is_variable):
    named = ()
    if is_variable(leaf):
      named = _spec_axes(leaf.get_metadata().get("optimizer_sharding"))
    axes.extend([named] * len(jax.tree.leaves(leaf)))
  return axes


def _variable_type() -> type | None:
  """Flax NNX's ``Variable`` class if flax is loaded, without importing it."""
  variablelib = sys.modules.get("flax.nnx.variablelib")
  return getattr(variablelib, "Variable", None)


def unwrap_variables(tree: Any) -> Any:
  """``tree`` with NNX ``Variable`` leaves replaced by the arrays they hold.

  ``nnx.Optimizer`` keeps its ``opt_state`` as a pytree whose array leaves
  are wrapped in ``OptState`` variables; readers of our state expect arrays.
  ``tree`` itself where flax is not loaded.
  """
  variable_type = _variable_type()
  if variable_type is None:
    return tree
  is_variable = lambda x: isinstance(x, variable_type)
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, tree,
                      is_leaf=is_variable)
