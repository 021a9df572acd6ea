"""FSDP memory policies: where one device's loop gathers and sums.

With parameters sharded over the data axis (FSDP, ZeRO-3), the micro-batch
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
  the gradient sum).

XLA moves loop-invariant code out of loops, all-gathers of shards that do not
change between micro-batches included. :func:`for_microbatch` ties the shards
to the micro-batch's index with :func:`jax.lax.optimization_barrier`, so that
the gathers stay where they are written. Each micro-batch's gradient is weighted
(and a micro-batch without tokens zeroed) before it is reduce-scattered,
because weights differ by device; differentiating through the gather would
scatter the unweighted gradient.
"""

import contextlib
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import axes
from optax_accum._src import grad_reduction as grad_reduction_lib
from optax_accum._src import sharding
from optax_accum._src import token_weighting

ONCE = "once"
EVERY_MICROBATCH = "every_microbatch"
DEFERRED = "deferred"  # gradient_sync only: see :func:`finish`.
CHOICES = (ONCE, EVERY_MICROBATCH)


class Policy(NamedTuple):
  """Where a data-parallel loop gathers parameters and syncs gradients."""

  gradient_sync: str = ONCE  # "once", "every_microbatch" or "deferred".
  gather_params: str = ONCE  # "once" or "every_microbatch".


def policy(gradient_sync: Any, gather_params: Any) -> Policy:
  """A checked :class:`Policy`, or an error naming the bad argument."""
  for name, value, choices in (
      ("gradient_sync", gradient_sync, CHOICES + (DEFERRED,)),
      ("gather_params", gather_params, CHOICES)):
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


def specs_like(params: Any, param_specs: Any, axis_name: axes.AxisName) -> Any:
  """``param_specs`` (a spec or a tree prefix) as one spec per parameter."""
  if isinstance(param_specs, P):
    spec = sharding.restrict(param_specs, axis_name)
    return jax.tree.map(lambda _: spec, params)
  try:
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(
            lambda _: sharding.restrict(spec, axis_name), sub
        ),
        param_specs, params, is_leaf=lambda x: isinstance(x, P),
    )
  except ValueError as e:
    raise ValueError(
        "param_specs must be a PartitionSpec or a tree prefix of the"
        f" parameters' tree {jax.tree.structure(params)}, got {param_specs!r}."
    ) from e


def _is_sharded(spec: P) -> bool:
  return bool(sharding.sharded_dims(spec))


@contextlib.contextmanager
def shards_need_param_specs(param_specs: Any, params: Any,
                            axis_name: axes.AxisName):
  """Names ``param_specs`` when a call inside shard_map fails on shards.

  Inside :func:`jax.shard_map` a parameter that varies over the data axis is
  either a shard (``in_specs`` naming the axis: FSDP) or a device-local copy;
  only ``param_specs`` tells them apart. Without it the loop takes shards for
  whole parameters and the loss fails on their shapes; that error is raised
  again as a ValueError that says what to pass.
  """
  data_axes = set(axes.axes_of(axis_name))
  varying = [] if param_specs is not None else [
      f"params{jax.tree_util.keystr(path)}"
      for path, leaf in jax.tree_util.tree_leaves_with_path(params)
      if data_axes & axes.varying_axes(leaf)]
  try:
    yield
  except (TypeError, ValueError) as e:
    if not varying:
      raise
    shown = ", ".join(varying[:3]) + (", ..." if len(varying) > 3 else "")
    raise ValueError(
        f"The call failed inside shard_map on parameters that vary over"
        f" axis_name={axis_name!r} ({shown}) with param_specs=None. If they"
        " are shards (in_specs naming the axis: FSDP), pass param_specs= with"
        " the same specs as the shard_map's in_specs, so that they are"
        f" gathered whole. The error was: {type(e).__name__}: {e}"
    ) from e


class Layout(NamedTuple):
  """How one device's micro-batch loop holds parameters and gradient sums."""

  specs: Any  # one PartitionSpec over axis_name per parameter leaf.
  axis_name: axes.AxisName
  policy: Policy


def layout(specs: Any, axis_name: axes.AxisName, chosen: Policy) -> Layout:
  """A :class:`Layout`; without sharded parameters every policy is "once".

  "deferred" is kept: it says where the data-parallel reduction happens
  (not in this call), which matters with or without sharded parameters.
  """
  if not any(_is_sharded(s) for s in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    deferred = chosen.gradient_sync == DEFERRED
    chosen = Policy(gradient_sync=DEFERRED if deferred else ONCE)
  return Layout(specs, axis_name, chosen)


def _gathers_in_loop(lay: Layout, spec: P) -> bool:
  return _is_sharded(spec) and lay.policy.gather_params == EVERY_MICROBATCH


def _syncs_in_loop(lay: Layout, spec: P) -> bool:
  return _is_sharded(spec) and lay.policy.gradient_sync == EVERY_MICROBATCH


def _whole(lay: Layout, shard: Any, spec: P) -> Any:
  """The device-local whole parameter from this device's shard."""
  return axes.device_local(sharding.gather(shard, spec), lay.axis_name)


def hold(lay: Layout, params: Any) -> Any:
  """What the loop closes over: whole parameters, or shards to gather later.

  Whole parameters are device-local, so that autodiff does not sum their
  gradients over the axis on every micro-batch.
  """
  return jax.tree.map(
      lambda p, s: p if _gathers_in_loop(lay, s) else _whole(lay, p, s),
      params, lay.specs,
  )


def for_microbatch(lay: Layout, held: Any, tie: Any) -> Any:
  """The whole parameters one micro-batch differentiates.

  ``tie`` is a value that changes with every micro-batch (its index):
  passing the shards through an optimization barrier with it keeps their
  all-gathers in the loop instead of hoisted out of it.
  """
  leaves, treedef = jax.tree.flatten(held)
  specs = treedef.flatten_up_to(lay.specs)
  shards = [i for i, s in enumerate(specs) if _gathers_in_loop(lay, s)]
  if not shards:
    return held
  tied, _ = lax.optimization_barrier(([leaves[i] for i in shards], tie))
  for i, shard in zip(shards, tied):
    leaves[i] = _whole(lay, shard, specs[i])
  return treedef.unflatten(leaves)


def _resized(shape: tuple[int, ...], spec: P, whole: bool) -> tuple[int, ...]:
  """A shard's shape made whole, or a whole shape made a shard's."""
  shape = list(shape)
  for dim, dim_axes in sharding.sharded_dims(spec):
    for axis in dim_axes:
      size = lax.axis_size(axis)
      shape[dim] = shape[dim] * size if whole else shape[dim] // size
  return tuple(shape)


def zero_grads(lay: Layout, held: Any, dtypes: Any) -> Any:
  """The loop's zero gradient sum, device-local, in ``dtypes`` (per leaf).

  ``held`` is what :func:`hold` returned. The sum is shaped like the shards
  under ``gradient_sync="every_microbatch"``, like the whole parameters
  otherwise.
  """

  def zeros(x, spec, dtype):
    wants_whole = not _syncs_in_loop(lay, spec)
    if wants_whole == (not _gathers_in_loop(lay, spec)):
      # zeros_like keeps the sharding over other mesh axes (model parallel).
      return jnp.zeros_like(x, dtype=dtype)
    shape = _resized(jnp.shape(x), spec, whole=wants_whole)
    return jnp.zeros(shape, dtype, out_sharding=sharding.explicit_spec(x))

  return axes.device_local(
      jax.tree.map(zeros, held, lay.specs, dtypes), lay.axis_name
  )


def add_grads(lay: Layout, total: Any, grads: Any,
              c: token_weighting.Contribution, rules=None) -> Any:
  """Adds one micro-batch's weighted gradient to the running sum.

  Under ``gradient_sync="every_microbatch"`` the weighted gradient of a
  sharded parameter is reduce-scattered into its shard first. ``rules``
  (``grad_reduction`` per leaf) may keep a replicated leaf's "max" or
  "last"; a sharded one's would need a max-scatter: refused.
  """

  def add(s, g, spec, rule):
    if rule != "mean":
      if _syncs_in_loop(lay, spec):
        raise ValueError(
            f"grad_reduction={rule!r} for a parameter sharded over"
            f" {lay.axis_name!r} needs gradient_sync='once', got"
            " gradient_sync='every_microbatch'."
        )
      return grad_reduction_lib.add(s, g, c, [rule])
    term = token_weighting.weighted(g, c, s.dtype)
    if _syncs_in_loop(lay, spec):
      term, _ = sharding.scatter(term, spec)
    return s + term.reshape(s.shape)

  leaves, treedef = jax.tree.flatten(total)
  rules = ["mean"] * len(leaves) if rules is None else rules
  return jax.tree.unflatten(treedef, [
      add(s, g, spec, rule) for s, g, spec, rule in zip(
          leaves, treedef.flatten_up_to(grads),
          treedef.flatten_up_to(lay.specs), rules)])


def finish(lay: Layout, total: Any, extra: Any) -> tuple[Any, Any]:
  """Sums the loop's gradient sum (and ``extra``) over the axis, once.

  Under ``gradient_sync="deferred"`` the gradient sums are only
  reduce-scattered over the axes that shard their parameters and stay this
  device's partials over the other data axes (to be typed unreduced there);
  ``extra`` (loss, token count, aux, scalars) is summed all the same.

  Returns ``(gradient sums sharded like the parameters, summed extra)``.
  """
  if lay.policy.gradient_sync in (ONCE, DEFERRED):
    return sharding.sum_into_shards(
        total, lay.specs, extra, lay.axis_name,
        keep_unreduced=lay.policy.gradient_sync == DEFERRED)
  leaves, treedef = jax.tree.flatten(total)
  specs = treedef.flatten_up_to(lay.specs)
  whole = [i for i, s in enumerate(specs) if not _is_sharded(s)]
  out = list(leaves)
  for i, (leaf, spec) in enumerate(zip(leaves, specs)):
    if i in whole:
      continue
    used = {a for _, dim_axes in sharding.sharded_dims(spec) for a in dim_axes}
    rest = tuple(a for a in axes.axes_of(lay.axis_name) if a not in used)
    # Already summed over the axes it is sharded over.
    out[i] = sharding.psum(leaf, rest) if rest else leaf
  summed, extra = sharding.psum(([leaves[i] for i in whole], extra),
                                lay.axis_name)
  for i, leaf in zip(whole, summed):
    out[i] = leaf
  return treedef.unflatten(out), extra
