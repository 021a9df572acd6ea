"""The layout of the ``manual`` and ``auto`` forms: data axes made manual.

Inside :func:`jax.shard_map` or :func:`jax.pmap` (``manual``), or inside the
runner's shard_map over the Auto data axes of a mesh (``auto``), each
device runs the loop on its shard of the batch and every collective is
written out. Parameters follow their layout over the data axes
(``specs``, :mod:`fsdp`'s policy): replicated ones are made device-local so
that autodiff does not sum their gradient over the axes on every
micro-batch, and are summed with one all-reduce after the loop; parameters
sharded over some data axes (FSDP, HSDP) are gathered (once, or for each
micro-batch) and their gradients reduce-scattered over those axes.

XLA moves loop-invariant code out of loops, all-gathers of shards that do not
change between micro-batches included. :meth:`ManualLayout.for_microbatch`
ties the shards to the micro-batch's index with
:func:`jax.lax.optimization_barrier`, so that the gathers stay where they are
written. Each micro-batch's gradient is weighted (and a micro-batch without
tokens zeroed) before it is reduce-scattered, because weights differ by
device; differentiating through the gather would scatter the unweighted
gradient.
"""

from collections.abc import Callable, Iterator
import contextlib
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from optax_accum._src import names
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import fsdp
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


def _is_sharded(spec: P) -> bool:
  return bool(readers.sharded_dims(spec))


def _over_rows(collective: Callable[[jax.Array], jax.Array],
               leaves: list[jax.Array]) -> list[jax.Array]:
  """Applies a collective over rows to ``leaves``: one call per dtype.

  Leaves of a dtype are flattened to ``(rows, features)`` and concatenated
  along the features, so that two towers' representations (or their
  cotangents) travel in one all-gather (or reduce-scatter), not one each.
  Leaves sharded over other Explicit mesh axes (tensor parallelism) travel
  one by one, on their local blocks (:func:`compat.blockwise`).
  """
  if any(readers.explicit_spec(x) is not None for x in leaves):
    return [compat.blockwise(collective, x) for x in leaves]
  groups = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(jnp.result_type(leaf), []).append(i)
  out = [None] * len(leaves)
  for members in groups.values():
    flat = [jnp.reshape(leaves[i], (jnp.shape(leaves[i])[0], -1))
            for i in members]
    packed = collective(jnp.concatenate(flat, axis=1))
    ends = np.cumsum([f.shape[1] for f in flat])[:-1]
    for i, part in zip(members, jnp.split(packed, ends, axis=1)):
      out[i] = part.reshape(packed.shape[:1] + jnp.shape(leaves[i])[1:])
  return out


class ManualLayout(NamedTuple):
  """How one device's loop holds parameters and sums over manual axes."""

  specs: Any  # one PartitionSpec over axis_name per parameter leaf.
  axis_name: readers.AxisName  # the data axes, manual here.
  policy: fsdp.Policy
  leaf_axes: list[int | None]  # the batch leaves' split axes.

  @property
  def device_axis(self) -> readers.AxisName:
    return self.axis_name

  @property
  def num_devices(self) -> int:
    return math.prod(lax.axis_size(a) for a in readers.axes_of(self.axis_name))

  def _gathers_in_loop(self, spec: P) -> bool:
    return self.policy.gathers_in_loop(_is_sharded(spec))

  def _syncs_in_loop(self, spec: P) -> bool:
    return self.policy.syncs_in_loop(_is_sharded(spec))

  def _whole(self, shard: Any, spec: P) -> Any:
    """The device-local whole parameter from this device's shard."""
    return axes.device_local(collectives.gather(shard, spec), self.axis_name)

  def split(self, batch, num_microbatches):
    return batching.split(batch, None, num_microbatches,
                          sharded_layout_for_auto=False,
                          known_axes=self.leaf_axes)

  def device_local(self, tree):
    return axes.device_local(tree, self.axis_name)

  def hold(self, params):
    """Whole parameters (device-local), or shards to gather in the loop."""
    return jax.tree.map(
        lambda p, s: p if self._gathers_in_loop(s) else self._whole(p, s),
        params, self.specs)

  def for_microbatch(self, held, index):
    """Shards pass an optimization barrier with ``index``, then gathers:
    XLA does not hoist them out of the loop."""
    leaves, treedef = jax.tree.flatten(held)
    specs = treedef.flatten_up_to(self.specs)
    return treedef.unflatten(fsdp.gathered_in_loop(
        leaves, [self._gathers_in_loop(s) for s in specs], index,
        lambda i, shard: self._whole(shard, specs[i])))

  def zero_grads(self, held, dtypes):
    """Shaped like the shards under ``gradient_sync="every_microbatch"``,
    like the whole parameters otherwise; device-local."""

    def zeros(x, spec, dtype):
      wants_whole = not self._syncs_in_loop(spec)
      if wants_whole == (not self._gathers_in_loop(spec)):
        # zeros_like keeps the sharding over other mesh axes.
        return jnp.zeros_like(x, dtype=dtype)
      shape = list(jnp.shape(x))
      for dim, dim_axes in readers.sharded_dims(spec):
        size = math.prod(lax.axis_size(a) for a in dim_axes)
        shape[dim] = shape[dim] * size if wants_whole else shape[dim] // size
      return jnp.zeros(shape, dtype, out_sharding=readers.explicit_spec(x))

    return self.device_local(jax.tree.map(zeros, held, self.specs, dtypes))

  def add_grads(self, total, grads, c, rules):
    """Under ``gradient_sync="every_microbatch"`` a sharded parameter's
    weighted gradient is reduce-scattered into its shard first; its "max"
    or "last" rule would need a max-scatter: refused."""

    def add(s, g, spec, rule):
      if rule != grad_reduction_lib.MEAN:
        if self._syncs_in_loop(spec):
          raise ValueError(
              f"grad_reduction={rule!r} for a parameter sharded over"
              f" {self.axis_name!r} needs gradient_sync='once', got"
              " gradient_sync='every_microbatch'."
          )
        return grad_reduction_lib.add_by_rule(s, g, c, [rule])
      term = token_weighting.weighted(g, c, s.dtype)
      if self._syncs_in_loop(spec):
        term, _ = collectives.scatter(term, spec)
      return s + term.reshape(s.shape)

    leaves, treedef = jax.tree.flatten(total)
    rules = [grad_reduction_lib.MEAN] * len(leaves) if rules is None else rules
    return jax.tree.unflatten(treedef, [
        add(s, g, spec, rule) for s, g, spec, rule in zip(
            leaves, treedef.flatten_up_to(grads),
            treedef.flatten_up_to(self.specs), rules)])

  def zero_stats(self):
    return [noise_scale.zero_sums()]

  def add_stats(self, stats, grads, c, loss_reduction, count_tokens,
                microbatch):
    """This device's micro-batch is a small batch (summed over devices in
    :meth:`reduce`, with the loss)."""
    del count_tokens, microbatch
    return [noise_scale.add_sq_norms(stats[0], grads, c, loss_reduction)]

  def sq_norms(self, tree):
    return [collectives.sq_norm_of_shards(tree, self.specs,
                                          noise_scale.sq_norm)]

  def after_loop(self, total, rules):
    """The "max" leaves' pmax, kept on the first device: the one sum over
    devices that follows then leaves them as they are."""
    return grad_reduction_lib.max_over_devices(
        total, rules, self.axis_name, keep_on_one_device=True)

  def reduces_only_after_loop(self):
    """Not a deferred sum of parameters sharded over no data axis (nothing
    reduced), nor one synced in each micro-batch."""
    specs = jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P))
    if any(self._syncs_in_loop(s) for s in specs):
      return False
    return (self.policy.gradient_sync != names.DEFERRED
            or any(_is_sharded(s) for s in specs))

  def reducible_in_loop(self):
    """Leaves all-reduced whole once per call: not sharded over the data
    axes, under ``gradient_sync="once"``."""
    specs = jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P))
    return [self.policy.gradient_sync == names.ONCE and not _is_sharded(s)
            and not self._gathers_in_loop(s) and not self._syncs_in_loop(s)
            for s in specs]

  def sum_in_loop(self, running, g, c):
    return lax.psum(running + token_weighting.weighted(g, c, running.dtype),
                    self.axis_name)

  def reduce(self, partials):
    """Sums the partials over the data axes: the one reduction of a call.

    A leaf with a part already summed in the loop (``partials.in_loop``)
    has the rest summed on its own and added: where the rest is zero (the
    leaf used only by the scan that reduced it) XLA drops that sum.
    """
    if partials.in_loop is not None:
      return self._reduce_rest(partials)
    grads, sums = self._finish(partials.grads, partials.sums)
    maxima = minima = []
    if partials.maxima:
      maxima = lax.pmax(partials.maxima, self.axis_name)
    if partials.minima:
      minima = lax.pmin(partials.minima, self.axis_name)
    means = partials.means
    if means is not None:
      means = model_state_over(means, self.axis_name)
    return partials._replace(grads=grads, sums=sums, maxima=maxima,
                             minima=minima, means=means)

  def _reduce_rest(self, partials: Any) -> Any:
    """:meth:`reduce`, the leaves with a part summed in the loop apart."""
    leaves, treedef = jax.tree.flatten(partials.grads)
    specs = treedef.flatten_up_to(self.specs)
    done = partials.in_loop
    rest = [x for x, t in zip(leaves, done) if t is None]
    others = self._replace(specs=[s for s, t in zip(specs, done) if t is None])
    out = others.reduce(partials._replace(grads=rest, in_loop=None))
    rest = iter(out.grads)
    return out._replace(grads=treedef.unflatten([
        next(rest) if t is None else lax.psum(x, self.axis_name) + t
        for x, t in zip(leaves, done)]))

  def _finish(self, total: Any, extra: Any) -> tuple[Any, Any]:
    """Sums the gradient sums (and ``extra``) over the axes, once.

    Under ``gradient_sync="deferred"`` the gradient sums are only
    reduce-scattered over the axes that shard their parameters and stay
    this device's partials over the other data axes (to be typed unreduced
    there); ``extra`` (loss, token count, aux, scalars) is summed all the
    same.
    """
    sync = self.policy.gradient_sync
    return collectives.sum_into_shards(
        total, self.specs, extra, self.axis_name,
        keep_unreduced=sync == names.DEFERRED,
        scattered=sync == names.EVERY_MICROBATCH)

  def gather_rows(self, reps, batch):
    """The representations all-gathered over the axes; ``batch`` stays this
    device's shard."""
    leaves, treedef = jax.tree.flatten(reps)
    return treedef.unflatten(_over_rows(
        lambda x: lax.all_gather(x, self.axis_name, axis=0, tiled=True),
        leaves)), batch

  def scatter_rows(self, cotangents, like):
    del like
    return _over_rows(
        lambda x: compat.summed_in_float32(
            lambda y: compat.psum_scatter(y, self.axis_name, 0), x),
        cotangents)

  def loss_params(self, held):
    return held

  def as_sums(self, tree):
    return self.device_local(tree)


def build_manual(params: Any, param_specs: Any, axis_name: readers.AxisName,
          policy: fsdp.Policy, leaf_axes: list[int | None]) -> ManualLayout:
  """The :class:`ManualLayout` of ``params`` (this device's: shards where
  ``param_specs`` says so, replicated without it).

  Without sharded parameters every policy is "once"; "deferred" is kept: it
  says where the data-parallel reduction happens (not in this call).
  """
  specs = fsdp.specs_like(params, P() if param_specs is None else param_specs,
                          axis_name)
  if not any(_is_sharded(s) for s in jax.tree.leaves(
      specs, is_leaf=lambda x: isinstance(x, P))):
    deferred = policy.gradient_sync == names.DEFERRED
    policy = fsdp.Policy(gradient_sync=names.DEFERRED if deferred
                         else names.ONCE)
  return ManualLayout(specs, axis_name, policy, leaf_axes)


@contextlib.contextmanager
def noting_shards(param_specs: Any, params: Any,
                  axis_name: readers.AxisName) -> Iterator[None]:
  """Adds a note naming ``param_specs`` to an error raised on shards.

  Inside :func:`jax.shard_map` a parameter that varies over the data axis is
  either a shard (``in_specs`` naming the axis: FSDP) or a device-local copy;
  only ``param_specs`` tells them apart. Without it the loop takes shards for
  whole parameters and the loss fails on their shapes: JAX's error is kept,
  with a note that says what to pass.
  """
  data_axes = set(readers.axes_of(axis_name))
  varying = [] if param_specs is not None else [
      f"params{jax.tree_util.keystr(path)}"
      for path, leaf in jax.tree_util.tree_leaves_with_path(params)
      if data_axes & axes.varying_axes(leaf)]
  if not varying:
    yield
    return
  try:
    yield
  except (TypeError, ValueError) as e:
    shown = ", ".join(varying[:3]) + (", ..." if len(varying) > 3 else "")
    e.add_note(
        f"optax_accum: the parameters vary over axis_name={axis_name!r}"
        f" ({shown}) with param_specs=None. If they are shards (in_specs"
        " naming the axis: FSDP), pass param_specs= with the same specs as"
        " the shard_map's in_specs, so that they are gathered whole.")
    raise


def _first_device(x: Any, axis_name: readers.AxisName) -> Any:
  """The first device's ``x``, on every device (a key, an int, a bool)."""
  is_key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  data = jax.random.key_data(x) if is_key else x
  is_bool = data.dtype == jnp.bool_
  if is_bool:
    data = data.astype(jnp.int32)
  data = lax.psum(manual.on_first_device(data, axis_name), axis_name)
  if is_bool:
    data = data.astype(jnp.bool_)
  if is_key:
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  return data


def model_state_over(tree: Any, axis_name: readers.AxisName) -> Any:
  """The model state after a data-parallel loop, the same on every device.

  Floating leaves (BatchNorm statistics) are averaged over the axis; the
  others (PRNG keys, counters), which no average suits, are the first
  device's.
  """
  return jax.tree.map(
      lambda x: lax.pmean(x, axis_name) if axes.is_floating(x)
      else _first_device(x, axis_name), tree
  )
