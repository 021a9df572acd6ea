"""Which parallel form a call runs in: the runner's dispatch, in one place.

An entry point (:func:`optax_accum.value_and_grad`,
:func:`optax_accum.coupled_value_and_grad`, the steps that
:func:`optax_accum.plan_microbatches` compiles) is called in one of three
forms:

* ``SINGLE``: no data axis to reduce over. One device, or :func:`jax.jit` of
  sharded inputs with XLA placing the collectives (no ``axis_name``), or an
  ``axis_name`` whose mesh axes all have size 1 (nothing to reduce).
* ``MANUAL``: ``axis_name`` names manual axes here (inside
  :func:`jax.shard_map` or :func:`jax.pmap`): the batch is this device's
  shard.
* ``MESH``: ``axis_name`` names axes of a mesh under :func:`jax.jit`: the
  mesh set by :func:`jax.set_mesh`, or, without it, the mesh that the
  inputs' types carry. The runner makes those axes manual for the length of
  the call.

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

from optax_accum._src import axes

SINGLE = "single"
MANUAL = "manual"
MESH = "mesh"


class Form(NamedTuple):
  """How one call runs: its kind, its data axes and the mesh to enter."""

  kind: str  # SINGLE, MANUAL or MESH.
  axis_name: axes.AxisName | None  # the data axes reduced over, or None.
  enter: Any  # an AbstractMesh read off the inputs, to enter; or None.


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


def detect(axis_name: axes.AxisName | None, *trees: Any) -> Form:
  """The :class:`Form` of a call with ``axis_name`` on inputs ``trees``."""
  if axis_name is not None and axes.is_bound(axis_name):
    return Form(MANUAL, axis_name, None)
  mesh, enter = current_mesh(*trees)
  if axis_name is None:
    return Form(SINGLE, None, enter)
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
  if not active:
    return Form(SINGLE, None, enter)
  return Form(MESH, active[0] if len(active) == 1 else active, enter)


def entered(form: Form) -> contextlib.AbstractContextManager:
  """A context that makes the form's mesh current, if it must be entered."""
  if form.enter is None:
    return nullcontext()
  return jax.sharding.use_abstract_mesh(form.enter)


def axis_size(axis_name: axes.AxisName) -> int:
  """The number of devices along ``axis_name`` in the current mesh."""
  sizes = _sizes(jax.sharding.get_abstract_mesh())
  return math.prod(sizes[a] for a in axes.axes_of(axis_name))
