"""Which parallel form a call runs in: the runner's dispatch, in one place.

The four forms, told for users in ``docs/distributed.md``, follow the type
of the data axes (JAX's ``AxisType``): ``SINGLE`` (no data axis to reduce
over), ``MANUAL`` (``axis_name`` names manual axes: inside
:func:`jax.shard_map` or :func:`jax.pmap`), ``AUTO`` (``axis_name`` names
Auto axes of a mesh under :func:`jax.jit`: the runner makes them manual for
the call) and ``TYPED`` (under :func:`jax.jit`, Explicit data axes, those
the batch is sharded over or ``axis_name``'s: the reduction is in the
types). :func:`detect` decides; the runner builds the form's
:class:`layout.Layout`.

A mesh read off the inputs is entered (:func:`jax.sharding.use_abstract_mesh`)
for the whole call, so that Explicit-sharded inputs work without
:func:`jax.set_mesh`, and an Auto-sharded batch is split without resharding.
Size-1 axes are dropped from the data axes: a reduction over them is the
identity, and XLA cannot partition one in a partially manual program.
"""

import contextlib
from contextlib import nullcontext
import math
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType

from optax_accum._src import axes
from optax_accum._src import sharding

SINGLE = "single"
MANUAL = "manual"
TYPED = "typed"
AUTO = "auto"


class Form(NamedTuple):
  """How one call runs: its kind, its data axes and the mesh to enter."""

  kind: str  # SINGLE, MANUAL, AUTO or TYPED.
  axis_name: axes.AxisName | None  # the data axes reduced over, or None.
  enter: Any  # an AbstractMesh read off the inputs, to enter; or None.
  leaf_axes: list[int | None]  # the batch leaves' split axes.


def _mesh_of(leaf: Any) -> Any:
  aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  return getattr(mesh, "abstract_mesh", mesh)


def inputs_mesh(*trees: Any) -> Any:
  """The abstract mesh the inputs' types carry, or None.

  Raises if two inputs carry different meshes (with more than one device).
  """
  found = None
  for leaf in jax.tree.leaves(trees):
    mesh = _mesh_of(leaf)
    if mesh is None or math.prod(mesh.axis_sizes) == 1:
      continue
    if found is None:
      found = mesh
    elif mesh != found:
      raise ValueError(
          "The inputs are sharded over two different meshes,"
          f" {found} and {mesh}: put them on one mesh (jax.device_put with"
          " NamedShardings of the same mesh), or set it with jax.set_mesh."
      )
  return found


def current_mesh(*trees: Any) -> tuple[Any, Any]:
  """``(mesh, to_enter)``: the mesh in effect and whether it must be entered.

  The mesh set by :func:`jax.set_mesh` wins; without one, the inputs' mesh
  (to enter); without either, ``(None, None)``.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh, None
  found = inputs_mesh(*trees)
  return found, found


def _sizes(mesh: Any) -> dict[str, int]:
  return dict(zip(mesh.axis_names, mesh.axis_sizes))


def batch_data_axes(batch: Any, leaf_axes: list[int | None]) -> tuple[str, ...]:
  """The Explicit mesh axes (size > 1, not manual) that shard the batch.

  Read off the type of each leaf's split axis; the leaves must agree.
  """
  found = {}
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  for (path, leaf), axis in zip(leaves, leaf_axes):
    if axis is None:
      continue
    spec = sharding.explicit_spec(leaf)
    entry = None if spec is None or axis >= len(spec) else spec[axis]
    mesh = jax.typeof(leaf).sharding.mesh if spec is not None else None
    names = () if entry is None else tuple(
        n for n in axes.axes_of(entry)
        if dict(mesh.shape)[n] > 1 and n not in set(
            getattr(mesh, "manual_axes", ()) or ()))
    found[jax.tree_util.keystr(path)] = names
  kinds = set(found.values())
  if len(kinds) > 1:
    raise ValueError(
        "The batch's leaves are sharded over different mesh axes along their"
        f" batch axes: {found}. Shard every split leaf over the same data"
        " axes (e.g. jax.device_put(batch, P('data')))."
    )
  return next(iter(kinds), ())


def _explicit(mesh: Any, names: tuple[str, ...]) -> bool:
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  return all(types.get(n) == AxisType.Explicit for n in names)


def _name(names: tuple[str, ...]) -> axes.AxisName:
  return names[0] if len(names) == 1 else names


def detect(axis_name: axes.AxisName | None, params: Any, batch: Any,
           leaf_axes: list[int | None]) -> Form:
  """The :class:`Form` of a call with ``axis_name`` on these inputs.

  ``leaf_axes`` are the batch leaves' split axes (:func:`batching.leaf_axes`).
  """
  if axis_name is not None and axes.is_bound(axis_name):
    return Form(MANUAL, axis_name, None, leaf_axes)
  mesh, enter = current_mesh(params, batch)
  typed = batch_data_axes(batch, leaf_axes)
  if axis_name is None:
    if typed:
      return Form(TYPED, _name(typed), enter, leaf_axes)
    return Form(SINGLE, None, enter, leaf_axes)
  sizes = {} if mesh is None else _sizes(mesh)
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  missing = [a for a in axes.axes_of(axis_name)
             if a not in sizes or a in manual]
  if missing:
    raise ValueError(
        f"axis_name={axis_name!r} is neither a manual axis here (inside"
        " jax.shard_map or jax.pmap) nor an axis of the current mesh (no"
        f" axis {missing[0]!r} in {mesh}): under jax.jit, set the mesh with"
        " jax.set_mesh(mesh), or pass inputs sharded over it"
        " (NamedShardings of a mesh with Explicit axes)."
    )
  active = tuple(a for a in axes.axes_of(axis_name) if sizes[a] > 1)
  if typed and set(typed) != set(active):
    raise ValueError(
        f"axis_name={axis_name!r} does not name the mesh axes that the"
        f" batch is sharded over along its batch axis, {list(typed)} (read"
        " off its type): the loop would reshard the batch on every call."
        f" Pass axis_name={_name(typed)!r}, or leave axis_name out (under"
        " jax.jit with Explicit axes the data axes are read off the"
        " batch)."
    )
  if not active:
    return Form(SINGLE, None, enter, leaf_axes)
  if _explicit(mesh, active):
    return Form(TYPED, _name(active), enter, leaf_axes)
  return Form(AUTO, _name(active), enter, leaf_axes)


def entered(form: Form) -> contextlib.AbstractContextManager:
  """A context that makes the form's mesh current, if it must be entered."""
  if form.enter is None:
    return nullcontext()
  return jax.sharding.use_abstract_mesh(form.enter)


def axis_size(axis_name: axes.AxisName) -> int:
  """The number of devices along ``axis_name`` in the current mesh."""
  sizes = _sizes(jax.sharding.get_abstract_mesh())
  return math.prod(sizes[a] for a in axes.axes_of(axis_name))
