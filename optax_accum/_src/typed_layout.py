"""The loop's layout with sharding in types: reduced weights, unreduced sums.

Under :func:`jax.jit` with Explicit data axes the loop runs ``loss_fn`` on
the global micro-batch, as ``jax.jit(jax.value_and_grad(loss_fn))`` would
(no axis is made manual). What keeps the gradient's reduction out of the
loop is a type (JAX's guide "Autodiff and sharding"): a parameter cast to
``reduced`` over the data axes (free: it is replicated there already) has an
``unreduced`` cotangent, each device's partial sum. The loop carries those
partials, and one :func:`jax.sharding.reshard` to the parameter's sharding
after it is the reduction (an all-reduce, or a reduce-scatter for a
parameter sharded over data axes).

The functions mirror :mod:`fsdp`'s for the manual forms (``hold``,
``for_microbatch``, ``zero_grads``, ``add_grads``, ``finish``), so that the
loop calls either through one :class:`Layout`. Per parameter leaf:

* *reduced* (the default): held whole, typed reduced over the data axes;
  its sum is unreduced. With ``gather_params="every_microbatch"`` a
  parameter sharded over data axes is held as its shard and gathered (to
  reduced) inside the loop, for each micro-batch; with
  ``gradient_sync="every_microbatch"`` each micro-batch's weighted gradient
  is reduce-scattered over those axes into a sum sharded like it and
  unreduced over the other data axes (HSDP).
* *replicated*: leaves that JAX cannot type reduced in the model as written
  (see :mod:`reduced_fallbacks`) and "max"/"last" leaves (whose rule needs
  each micro-batch's whole value). JAX reduces their gradient inside the
  loop, for each micro-batch; their sum is an ordinary replicated array.

The weighted add runs on each device's own partials
(:func:`compat.add_to_partials`): JAX has no unreduced rule for it yet.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import axes
from optax_accum._src import compat
from optax_accum._src import fsdp
from optax_accum._src import grad_reduction as grad_reduction_lib
from optax_accum._src import sharding
from optax_accum._src import token_weighting


class Layout(NamedTuple):
  """How the typed loop holds each parameter leaf and sums its gradient."""

  axis_name: axes.AxisName  # the data axes (Explicit, each of size > 1).
  treedef: Any  # the parameters' structure.
  targets: list[P]  # per leaf: the gradient's spec (the parameter's).
  reduced: list[bool]  # per leaf: cast reduced (else kept replicated).
  policy: fsdp.Policy


def _entries(spec: P, ndim: int) -> list[Any]:
  entries = list(sharding.partitions(spec))
  return entries + [None] * (ndim - len(entries))


def data_axes_in(spec: P, axis_name: axes.AxisName) -> tuple[str, ...]:
  """The data axes that shard a dimension of ``spec``, in mesh order."""
  used = {n for e in sharding.partitions(spec) if e is not None
          for n in axes.axes_of(e)}
  return tuple(a for a in axes.axes_of(axis_name) if a in used)


def _drop(spec: P, names: tuple[str, ...], ndim: int) -> list[Any]:
  """``spec``'s entries with the mesh axes ``names`` dropped."""
  return [
      None if e is None else sharding.entry(
          tuple(n for n in axes.axes_of(e) if n not in names))
      for e in _entries(spec, ndim)
  ]


def merged_spec(type_spec: P, data_spec: P | None, axis_name: axes.AxisName,
                ndim: int) -> P:
  """A parameter's spec: its type's, over data axes as ``data_spec`` says.

  ``data_spec`` (``param_specs=``, restricted to the data axes) replaces the
  type's entries over data axes; None keeps them.
  """
  if data_spec is None:
    return P(*_entries(type_spec, ndim))
  kept = _drop(type_spec, axes.axes_of(axis_name), ndim)
  given = _entries(data_spec, ndim)
  return P(*[
      sharding.entry(tuple(axes.axes_of(g) if g is not None else ())
                     + tuple(axes.axes_of(k) if k is not None else ()))
      for k, g in zip(kept, given)
  ])


def _data(lay: Layout) -> frozenset[str]:
  return frozenset(axes.axes_of(lay.axis_name))


def whole_spec(lay: Layout, i: int, ndim: int, *, reduced: bool) -> P:
  """Leaf ``i`` held whole over the data axes (its model axes kept)."""
  entries = _drop(lay.targets[i], axes.axes_of(lay.axis_name), ndim)
  return P(*entries, reduced=_data(lay) if reduced else frozenset())


def _sharded(lay: Layout, i: int) -> bool:
  return bool(data_axes_in(lay.targets[i], lay.axis_name))


def _gathers_in_loop(lay: Layout, i: int) -> bool:
  return (lay.reduced[i] and _sharded(lay, i)
          and lay.policy.gather_params == fsdp.EVERY_MICROBATCH)


def _syncs_in_loop(lay: Layout, i: int) -> bool:
  return (lay.reduced[i] and _sharded(lay, i)
          and lay.policy.gradient_sync == fsdp.EVERY_MICROBATCH)


def _unreduced_over_rest(lay: Layout, i: int) -> P:
  """Sharded like the parameter, unreduced over the other data axes."""
  rest = _data(lay) - set(data_axes_in(lay.targets[i], lay.axis_name))
  return P(*sharding.partitions(lay.targets[i]), unreduced=rest)


def sum_spec(lay: Layout, i: int, ndim: int) -> P:
  """The spec of leaf ``i``'s running sum in the loop's carry."""
  if not lay.reduced[i]:
    return whole_spec(lay, i, ndim, reduced=False)
  if _syncs_in_loop(lay, i):
    return _unreduced_over_rest(lay, i)
  return _whole_partial(lay, i, ndim)


def _leaves(lay: Layout, tree: Any) -> list[Any]:
  return lay.treedef.flatten_up_to(tree)


def hold(lay: Layout, params: Any) -> Any:
  """What the loop closes over: whole parameters (reduced), or shards.

  A parameter gathered in the loop is held as its shard; the others are
  gathered here, once, if sharded over data axes.
  """
  out = []
  for i, p in enumerate(_leaves(lay, params)):
    if _gathers_in_loop(lay, i):
      out.append(jax.sharding.reshard(p, lay.targets[i]))
    else:
      out.append(jax.sharding.reshard(
          p, whole_spec(lay, i, jnp.ndim(p), reduced=lay.reduced[i])))
  return lay.treedef.unflatten(out)


def for_microbatch(lay: Layout, held: Any, tie: Any) -> Any:
  """The whole parameters one micro-batch differentiates.

  Shards gathered in the loop pass an optimization barrier with ``tie``
  (the micro-batch's index), so that XLA does not hoist their gathers.
  """
  leaves = _leaves(lay, held)
  shards = [i for i in range(len(leaves)) if _gathers_in_loop(lay, i)]
  if not shards:
    return held
  tied, _ = lax.optimization_barrier(([leaves[i] for i in shards], tie))
  for i, shard in zip(shards, tied):
    leaves[i] = jax.sharding.reshard(
        shard, whole_spec(lay, i, jnp.ndim(shard), reduced=True))
  return lay.treedef.unflatten(leaves)


def zero_grads(lay: Layout, held: Any, dtypes: Any) -> Any:
  """The loop's zero gradient sums, typed as :func:`sum_spec` says."""
  leaves = _leaves(lay, held)
  return lay.treedef.unflatten([
      jnp.zeros(jnp.shape(p), dtype,
                out_sharding=sum_spec(lay, i, jnp.ndim(p)))
      for i, (p, dtype) in enumerate(zip(leaves, _leaves(lay, dtypes)))
  ])


def _as_partial(g: Any, spec: P) -> Any:
  """``g`` typed ``spec`` (unreduced over the data axes).

  A gradient that JAX already reduced (of a parameter the loss does not
  use) is cast: its value on one device, zeros on the others.
  """
  if sharding.full_spec(g) == spec:
    return g
  return compat.cast_unreduced(g, spec)


def gathered(lay: Layout, tree: Any) -> Any:
  """``tree`` replicated over the data axes (its model axes kept)."""
  names = axes.axes_of(lay.axis_name)
  return jax.tree.map(lambda x: jax.sharding.reshard(
      x, P(*_drop(sharding.full_spec(x), names, jnp.ndim(x)))), tree)


def replicated(lay: Layout, held: Any) -> Any:
  """Held parameters as plain replicated ones (free: no data moves)."""
  return lay.treedef.unflatten([
      jax.sharding.reshard(p, whole_spec(lay, i, jnp.ndim(p), reduced=False))
      for i, p in enumerate(_leaves(lay, held))
  ])


def as_sums(lay: Layout, grads: Any) -> Any:
  """Gradients typed like the loop's sums (:func:`sum_spec`), for free.

  A reduced leaf's gradient (of its whole parameter) becomes unreduced; a
  gradient that JAX already reduced is cast, its value on one device.
  """
  return lay.treedef.unflatten([
      _as_partial(g, sum_spec(lay, i, jnp.ndim(g))) if lay.reduced[i] else g
      for i, g in enumerate(_leaves(lay, grads))
  ])


def add_grads(lay: Layout, total: Any, grads: Any,
              c: token_weighting.Contribution, rules=None) -> Any:
  """Adds one micro-batch's weighted gradient to the running sums.

  Replicated leaves follow their rule (:mod:`grad_reduction`); unreduced
  ones are weighted on each device's own partial (a kept micro-batch adds
  ``weight * g``, another nothing: its partial is never looked at). Under
  ``gradient_sync="every_microbatch"`` a sharded parameter's weighted
  partial is reduce-scattered into its sum.
  """
  sums, grads = _leaves(lay, total), _leaves(lay, grads)
  rules = ["mean"] * len(sums) if rules is None else rules
  out = list(sums)
  local = []  # (leaf, partial gradient, what it is added to)
  for i, (s, g) in enumerate(zip(sums, grads)):
    if not lay.reduced[i]:
      out[i] = grad_reduction_lib.add(s, g, c, [rules[i]])
      continue
    g = _as_partial(g, _whole_partial(lay, i, jnp.ndim(g)))
    base = s if not _syncs_in_loop(lay, i) else jnp.zeros(
        jnp.shape(g), s.dtype, out_sharding=sharding.full_spec(g))
    local.append((i, g, base))
  if local:
    new = compat.add_to_partials(
        lambda gs, bs, c: [b + token_weighting.weighted(g, c, b.dtype)
                           for g, b in zip(gs, bs)],
        [g for _, g, _ in local], [b for _, _, b in local], c)
    for (i, _, _), value in zip(local, new):
      if _syncs_in_loop(lay, i):
        value = sums[i] + jax.sharding.reshard(
            value, sharding.full_spec(sums[i]))
      out[i] = value
  return lay.treedef.unflatten(out)


def _whole_partial(lay: Layout, i: int, ndim: int) -> P:
  """A whole gradient's type: unreduced over every data axis."""
  entries = _drop(lay.targets[i], axes.axes_of(lay.axis_name), ndim)
  return P(*entries, unreduced=_data(lay))


def finish(lay: Layout, total: Any) -> Any:
  """The one reduction: each sum resharded to its parameter's sharding.

  With ``gradient_sync="deferred"`` the sums are only reduce-scattered over
  the data axes that shard their parameter and stay unreduced over the
  others (a replicated sum is cast there, its value on one device).
  """
  deferred = lay.policy.gradient_sync == fsdp.DEFERRED

  def finished(i, s):
    if not deferred:
      return jax.sharding.reshard(s, lay.targets[i])
    if lay.reduced[i]:  # a reduce-scatter over the axes that shard it.
      return jax.sharding.reshard(s, _unreduced_over_rest(lay, i))
    return compat.cast_unreduced(s, _unreduced_over_rest(lay, i))

  return lay.treedef.unflatten(
      [finished(i, s) for i, s in enumerate(_leaves(lay, total))])


def summed(lay: Layout, grads: Any) -> Any:
  """A micro-batch's gradient reduced over the data axes (with_stats only:
  a gradient-sized reduction per micro-batch)."""
  return lay.treedef.unflatten([
      jax.sharding.reshard(g, whole_spec(lay, i, jnp.ndim(g), reduced=False))
      if lay.reduced[i] else g
      for i, g in enumerate(_leaves(lay, grads))
  ])
