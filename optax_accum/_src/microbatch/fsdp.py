"""FSDP memory policies: where a data-parallel loop gathers and syncs.

With parameters sharded over the data axes (FSDP, ZeRO-3), the micro-batch
loop can hold them and their gradient sum in two ways each:

* ``gather_params="once"``: all-gather the parameters before the loop and keep
  them whole through it (one all-gather per sharded leaf and update);
  ``"every_microbatch"``: keep the shards and all-gather inside the loop, for
  each micro-batch (``k`` per leaf and update, 1/N of the parameters held
  between micro-batches).
* ``gradient_sync="once"``: keep a whole-size partial gradient sum per device
  and reduce-scatter it after the loop (one per sharded leaf and update);
  ``"every_microbatch"``: reduce-scatter each micro-batch's weighted gradient
  into a sum sharded like the parameters (``k`` per leaf and update, 1/N of
  the gradient sum); ``"deferred"``: no reduction of the gradient over the
  data axes in this call (each device's partial comes back).

Both layouts with data axes read it: :mod:`manual_layout` and
:mod:`typed_layout`. Before either is built, the runner calls
:func:`check_fits_mesh`, which refuses ``param_specs`` the mesh cannot hold,
and :func:`warn_if_sync_unused`, which warns of a ``gradient_sync`` that no
leaf is sharded for.
"""

from collections.abc import Callable
import math
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum._src import caller_warnings
from optax_accum._src import names
from optax_accum._src.mesh import readers


class Policy(NamedTuple):
  """Where a data-parallel loop gathers parameters and syncs gradients."""

  gradient_sync: str = names.ONCE  # "once", "every_microbatch" or "deferred".
  gather_params: str = names.ONCE  # "once" or "every_microbatch".

  def gathers_in_loop(self, sharded: bool) -> bool:
    """Whether a leaf (sharded over data axes or not) is gathered in the
    loop, for each micro-batch."""
    return sharded and self.gather_params == names.EVERY_MICROBATCH

  def syncs_in_loop(self, sharded: bool) -> bool:
    """Whether a leaf's gradient is reduce-scattered in the loop, for each
    micro-batch, into a sum sharded like it."""
    return sharded and self.gradient_sync == names.EVERY_MICROBATCH


def gathered_in_loop(leaves: list[Any], in_loop: list[bool], index: Any,
                     whole: Callable[[int, Any], Any]) -> list[Any]:
  """Leaves gathered in the loop: ``whole(i, shard)`` for each ``in_loop``.

  The shards first pass an optimization barrier with the micro-batch
  ``index``, so that XLA cannot hoist their gathers out of the loop (which
  would hold the whole parameters through it, the memory the policy saves).
  """
  shards = [i for i, flag in enumerate(in_loop) if flag]
  if not shards:
    return leaves
  tied, _ = lax.optimization_barrier(([leaves[i] for i in shards], index))
  leaves = list(leaves)
  for i, shard in zip(shards, tied):
    leaves[i] = whole(i, shard)
  return leaves


def policy(gradient_sync: Any, gather_params: Any) -> Policy:
  """A checked :class:`Policy`, or an error naming the bad argument."""
  for name, value, choices in (
      ("gradient_sync", gradient_sync, names.CHOICES + (names.DEFERRED,)),
      ("gather_params", gather_params, names.CHOICES)):
    if not isinstance(value, str) or value not in choices:
      raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
  return Policy(gradient_sync, gather_params)


def check_param_specs(param_specs: Any) -> Any:
  """Checks ``param_specs``: None, a PartitionSpec or a tree of them."""
  if param_specs is None:
    return None
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      param_specs, is_leaf=lambda x: isinstance(x, P)
  ):
    if not isinstance(leaf, P):
      raise TypeError(
          f"param_specs{jax.tree_util.keystr(path)} must be a"
          f" jax.sharding.PartitionSpec, got {leaf!r} of type"
          f" {type(leaf).__name__}."
      )
  return param_specs


def specs_like(params: Any, param_specs: Any,
               axis_name: readers.AxisName) -> Any:
  """``param_specs`` (a spec or a tree prefix) as one spec per parameter."""
  if isinstance(param_specs, P):
    spec = readers.restrict(param_specs, axis_name)
    return jax.tree.map(lambda _: spec, params)
  try:
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(
            lambda _: readers.restrict(spec, axis_name), sub
        ),
        param_specs, params, is_leaf=lambda x: isinstance(x, P),
    )
  except ValueError as e:
    raise ValueError(
        "param_specs must be a PartitionSpec or a tree prefix of the"
        f" parameters' tree {jax.tree.structure(params)}, got {param_specs!r}."
    ) from e


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def check_fits_mesh(params: Any, param_specs: Any,
                    axis_name: readers.AxisName, *, whole: bool) -> None:
  """Refuses ``param_specs`` that the current mesh cannot hold.

  Without this, :func:`specs_like` drops an axis the mesh lacks (FSDP or
  ZeRO silently off), :func:`readers.merged_spec` a dimension the leaf
  lacks, and a data axis whose size does not divide its dimension ends in
  JAX's error deep inside the loop, naming neither. ``whole``: the
  parameters are global arrays (under :func:`jax.jit`), so the division
  can be checked; inside :func:`jax.shard_map` they are this device's.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if param_specs is None or mesh.empty:  # pmap: no mesh to check against.
    return
  zero_specs = f"oa.zero_specs(params, {axis_name!r})"
  for path, spec in jax.tree_util.tree_leaves_with_path(param_specs,
                                                        is_leaf=_is_spec):
    unknown = readers.missing_axes(readers.spec_names(spec), mesh)
    if unknown:
      raise ValueError(
          f"param_specs{jax.tree_util.keystr(path)}={spec} names the axis"
          f" {unknown[0]!r}, which the mesh lacks (its axes:"
          f" {readers.axis_sizes(mesh)}), so the leaves it covers would not"
          " be sharded over it. Name axes of the mesh (the data axes:"
          f" {axis_name!r}); for ZeRO, take the specs from {zero_specs}.")
  fix = (f"{zero_specs} places the data axes on a dimension that their size"
         " divides, or leaves the leaf whole")
  specs = jax.tree.leaves(specs_like(params, param_specs, axis_name),
                          is_leaf=_is_spec)
  for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                specs):
    unfit = _unfit_dimension(leaf, spec, axis_name, whole)
    if unfit:
      raise ValueError(
          f"param_specs shards params{jax.tree_util.keystr(path)} over"
          f" {unfit.given!r} on {unfit.where} (mesh axes"
          f" {readers.axis_sizes(mesh)}). Shard a dimension that"
          f" {unfit.count} divides, or keep the leaf whole (P()): {fix}.")


class _Unfit(NamedTuple):
  """A dimension of a leaf that its spec over the data axes cannot shard."""

  given: Any  # the spec's entry over the data axes, e.g. "data".
  where: str  # which dimension, and why not, in words.
  count: int  # the number of shards it asks for.


def _unfit_dimension(leaf: Any, spec: P, axis_name: readers.AxisName,
                     whole: bool) -> _Unfit | None:
  """The first dimension ``spec`` shards that ``leaf`` lacks, or (for a
  ``whole`` leaf) whose size the shards do not divide; None if none."""
  shape = tuple(jax.numpy.shape(leaf))
  own = readers.padded_entries(readers.explicit_spec(leaf) or P(),
                               len(shape))
  sizes = readers.axis_sizes(jax.sharding.get_abstract_mesh())
  for dim, given in readers.sharded_dims(spec):
    if dim >= len(shape):
      held = "a leaf" if whole else "this device's shard"
      return _Unfit(readers.entry(given),
                    f"dimension {dim}, which {held} of shape {shape} lacks",
                    math.prod(sizes[a] for a in given))
    # With the type's other axes on that dimension, as merged_spec does.
    axes = given + tuple(n for n in readers.axes_of(own[dim] or ())
                         if n not in readers.axes_of(axis_name))
    count = math.prod(sizes[a] for a in axes)
    if whole and shape[dim] % count:
      return _Unfit(
          readers.entry(given),
          f"dimension {dim} of shape {shape}, whose size {shape[dim]} the"
          f" {count} devices of {readers.entry(axes)!r} do not divide", count)
  return None


# The data axes already warned about by warn_if_sync_unused.
_warned_unused: set[tuple[str, ...]] = set()


def warn_if_sync_unused(data_specs: Any,
                        axis_name: readers.AxisName) -> None:
  """Warns once where ``gradient_sync="every_microbatch"`` does nothing.

  It reduce-scatters each micro-batch's gradient of the leaves sharded over
  the data axes; with none (``data_specs``: each leaf's spec over them), the
  gradient is reduced once, after the loop, whole, as with ``"once"``. In a
  loop of one jit call per micro-batch that is the easy mistake of asking
  ``oa.value_and_grad`` for ZeRO-2, which ``oa.accumulate`` does. Called
  only with that policy.
  """
  if any(readers.sharded_dims(s)
         for s in jax.tree.leaves(data_specs, is_leaf=_is_spec)):
    return
  key = readers.axes_of(axis_name)
  if key in _warned_unused:
    return
  _warned_unused.add(key)
  data = readers.entry(key)
  caller_warnings.warn(
      "gradient_sync='every_microbatch' does nothing here: no parameter leaf"
      f" is sharded over the data axes {data!r} (by its type or by"
      " param_specs), so the whole gradient is all-reduced once per call, as"
      " with 'once'. That is not ZeRO-2. In a loop of one jit call per"
      " micro-batch, ZeRO-2 is oa.accumulate(..., shard_optimizer="
      f"{data!r}, gradient_sync='every_microbatch') fed the gradients of"
      " oa.value_and_grad(..., gradient_sync='deferred'); within one call,"
      " it is this gradient_sync with param_specs=oa.zero_specs(params,"
      f" {data!r}). Parameters sharded over the data axes (FSDP) take it as"
      " they are. docs/zero.md, 'Which call takes which argument', has the"
      " table.",
      UserWarning)
