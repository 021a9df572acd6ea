"""Which parallel form a call runs in: the runner's dispatch, in one place.

The four forms, told for users in ``docs/distributed.md``, follow the type
of the data axes (JAX's ``AxisType``): ``SINGLE`` (no data axis to reduce
over), ``MANUAL`` (``axis_name`` names manual axes: inside
:func:`jax.shard_map` or :func:`jax.pmap`), ``AUTO`` (``axis_name`` names
Auto axes of a mesh under :func:`jax.jit`: the runner makes them manual for
the call) and ``TYPED`` (under :func:`jax.jit`, Explicit data axes, those
the batch is sharded over or ``axis_name``'s: the reduction is in the
types; only on a mesh whose axes are all Explicit, else refused by
:func:`refuse_mixed_axis_types`). :func:`detect_form` decides; the runner
builds the form's :class:`layout.Layout`.

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

from optax_accum._src import caller_warnings
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers

SINGLE = "single"
MANUAL = "manual"
TYPED = "typed"
AUTO = "auto"


class Form(NamedTuple):
  """How one call runs: its kind, its data axes and the mesh to enter."""

  kind: str  # SINGLE, MANUAL, AUTO or TYPED.
  axis_name: readers.AxisName | None  # the data axes reduced over, or None.
  enter: Any  # an AbstractMesh read off the inputs, to enter; or None.
  leaf_axes: list[int | None]  # the batch leaves' split axes.


def inputs_mesh(*trees: Any) -> Any:
  """The abstract mesh the inputs' types carry, or None.

  Raises if two inputs carry different meshes (with more than one device).
  """
  found = None
  for leaf in jax.tree.leaves(trees):
    mesh = readers.mesh_of(leaf)
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


def batch_data_axes(batch: Any, leaf_axes: list[int | None]) -> tuple[str, ...]:
  """The Explicit mesh axes (size > 1, not manual) that shard the batch.

  Read off the type of each leaf's split axis; the leaves must agree.
  """
  found = {}
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  for (path, leaf), axis in zip(leaves, leaf_axes):
    if axis is None:
      continue
    spec = readers.explicit_spec(leaf)
    entry = None if spec is None or axis >= len(spec) else spec[axis]
    mesh = readers.mesh_of(leaf) if spec is not None else None
    names = () if entry is None else tuple(
        n for n in readers.axes_of(entry)
        if readers.axis_sizes(mesh)[n] > 1 and n not in set(
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


def detect_form(axis_name: readers.AxisName | None, params: Any, batch: Any,
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
      refuse_mixed_axis_types(mesh, typed, None)
      return Form(TYPED, readers.entry(typed), enter, leaf_axes)
    warn_auto_batch(mesh, batch, leaf_axes)
    return Form(SINGLE, None, enter, leaf_axes)
  sizes = {} if mesh is None else readers.axis_sizes(mesh)
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  missing = [a for a in readers.axes_of(axis_name)
             if a not in sizes or a in manual]
  if missing:
    raise ValueError(
        f"axis_name={axis_name!r} is neither a manual axis here (inside"
        " jax.shard_map or jax.pmap) nor an axis of the current mesh (no"
        f" axis {missing[0]!r} in {mesh}): under jax.jit, set the mesh with"
        " jax.set_mesh(mesh), or pass inputs sharded over it"
        " (NamedShardings of a mesh with Explicit axes)."
    )
  active = tuple(a for a in readers.axes_of(axis_name) if sizes[a] > 1)
  if typed and set(typed) != set(active):
    raise ValueError(
        f"axis_name={axis_name!r} does not name the mesh axes that the"
        f" batch is sharded over along its batch axis, {list(typed)} (read"
        " off its type): the loop would reshard the batch on every call."
        f" Pass axis_name={readers.entry(typed)!r}, or leave axis_name out"
        " (under"
        " jax.jit with Explicit axes the data axes are read off the"
        " batch)."
    )
  if not active:
    return Form(SINGLE, None, enter, leaf_axes)
  if readers.are_explicit(mesh, active):
    refuse_mixed_axis_types(mesh, active, axis_name)
    return Form(TYPED, readers.entry(active), enter, leaf_axes)
  return Form(AUTO, readers.entry(active), enter, leaf_axes)


def refuse_mixed_axis_types(mesh: Any, data_axes: tuple[str, ...],
                            axis_name: readers.AxisName | None) -> None:
  """Workaround: XLA miscompiles ``unreduced`` types on a mesh that mixes
  axis types, so the typed form runs only where every axis is Explicit.

  On ``jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(Explicit,
  Auto))`` (the Auto axis of any size, 1 included) the weights' gradient
  of the typed loop came back multiplied by the size of ``data``, silently
  (Equinox's ``Linear``: a matrix-vector product under ``vmap``; seen on
  jax 0.9.1 and 0.10.2). On 0.10.2 a plain ``jnp.einsum`` of a weight typed
  ``reduced`` and a batch-sharded activation shows why: JAX lowers the
  ``unreduced`` constraint with open shardings (``{?}``), and the SPMD
  partitioner all-reduces the dot's output itself before the reshard
  all-reduces it again. Next to a Manual axis (inside a
  :func:`jax.shard_map` over another axis) XLA aborts the process ("Only one
  of unreduced and manual axes can be present"). Both are refused here, at
  trace time, before XLA sees them. Remove when jax lowers ``unreduced`` on
  a mesh with Auto and Manual axes as it does on an all-Explicit one
  (``tests/forms/test_mixed_axis_types.py::test_xla_still_double_counts`` fails
  then).
  """
  types = {n: t.name for n, t in readers.axis_types(mesh).items()}
  others = {n: t for n, t in types.items() if t != AxisType.Explicit.name}
  if not others:
    return
  given = ("the batch is sharded over" if axis_name is None
           else f"axis_name={axis_name!r} names")
  name = readers.entry(data_axes)
  manual = [n for n, t in others.items() if t == AxisType.Manual.name]
  fix = (
      f"Make the data axes {list(data_axes)} manual too (a jax.shard_map"
      f" over them as well) and pass axis_name={name!r}, or call it outside"
      " the jax.shard_map." if manual else
      "Make every axis of the mesh Explicit (jax.make_mesh(shape, names,"
      " axis_types=(AxisType.Explicit,) * len(shape))): the loop then types"
      " the gradient and reduces it once. Or make the data axes Auto as well"
      f" and pass axis_name={name!r}: the loop then runs in a jax.shard_map"
      " over them and reduces once."
  )
  raise ValueError(
      f"The mesh mixes axis types, {types}, and {given} the Explicit axes"
      f" {list(data_axes)}: optax_accum's typed form (parameters typed"
      " reduced, gradient sums unreduced over the data axes) is refused on"
      " such a mesh: " + (
          "next to Manual axes XLA aborts the process on unreduced types."
          if manual else
          "next to Auto axes XLA miscompiles unreduced types (the weights'"
          " gradient came back counted once per device).") + " " + fix
  )


# The meshes already warned about by warn_auto_batch: (axis names, sizes).
_warned_auto: set[tuple[Any, ...]] = set()


def _batch_auto_axes(batch: Any, leaf_axes: list[int | None],
                     auto: dict[str, int]) -> tuple[str, ...] | None:
  """The Auto axes the batch is sharded over along its split axes, or None
  where that is hidden: a traced leaf whose type does not shard its split
  axis (Auto shardings are not in types)."""
  found: list[str] = []
  for leaf, axis in zip(jax.tree.leaves(batch), leaf_axes):
    if axis is None:
      continue
    if isinstance(leaf, jax.core.Tracer):
      entry = _entry(jax.typeof(leaf), axis)
      if entry is None:
        return None
    else:
      entry = _entry(leaf, axis)
    found += [n for n in readers.axes_of(entry or ()) if n in auto
              and n not in found]
  return tuple(found)


def _entry(value: Any, axis: int) -> Any:
  """The mesh axes along ``axis`` in ``value``'s (or its type's) sharding."""
  spec = readers.placed_spec(value)
  entries = () if spec is None else readers.partitions(spec)
  return entries[axis] if axis < len(entries) else None


def warn_auto_batch(mesh: Any, batch: Any,
                    leaf_axes: list[int | None]) -> None:
  """Warns once per mesh where XLA may reduce every micro-batch's gradient.

  Without ``axis_name``, on a mesh with Auto axes, a batch sharded over them
  runs as :func:`jax.jit` places it: exact, but each micro-batch's gradient
  is all-reduced inside the loop. Auto shardings are not in the types, so
  under :func:`jax.jit` the warning says "if"; a concrete batch that is not
  sharded over them is not warned about.
  """
  auto = readers.auto_axes(mesh)
  if not auto or all(a is None for a in leaf_axes):
    return
  sharded = _batch_auto_axes(batch, leaf_axes, auto)
  if sharded == ():
    return
  key = (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
  if key in _warned_auto:
    return
  _warned_auto.add(key)
  over = sharded or tuple(auto)
  if_sharded = ("The batch is sharded over" if sharded else
                "If the batch is sharded over")
  message = (
      f"{if_sharded} the Auto mesh axes {list(over)} and axis_name is None:"
      " the micro-batch loop runs as jax.jit places it, exact, but XLA"
      " all-reduces the gradient of every micro-batch inside the loop"
      " (num_microbatches gradient-sized all-reduces per call, where one"
      " after the loop would do; measured on the CPU backend, whose compiler"
      " keeps them in the loop). Pass axis_name naming them"
      f" (axis_name={readers.entry(over)!r}): the loop then runs in a"
      " jax.shard_map"
      " over those axes and reduces once, after it. Or make the mesh's axes"
      " Explicit (jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))):"
      " the data axes are then read off the batch's type and reduced once."
  )
  caller_warnings.warn(message, UserWarning)


def entered(form: Form) -> contextlib.AbstractContextManager:
  """A context that makes the form's mesh current, if it must be entered."""
  if form.enter is None:
    return nullcontext()
  return jax.sharding.use_abstract_mesh(form.enter)


def axis_size(axis_name: readers.AxisName) -> int:
  """The number of devices along ``axis_name`` in the current mesh."""
  sizes = readers.axis_sizes(jax.sharding.get_abstract_mesh())
  return math.prod(sizes[a] for a in readers.axes_of(axis_name))
