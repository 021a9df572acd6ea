"""The layout of the ``typed`` form: reduced weights, unreduced sums.

Under :func:`jax.jit` with Explicit data axes the loop runs ``loss_fn`` on
the global micro-batch, as ``jax.jit(jax.value_and_grad(loss_fn))`` would
(no axis is made manual). What keeps the gradient's reduction out of the
loop is a type (JAX's guide "Autodiff and sharding"): a parameter cast to
``reduced`` over the data axes (free: it is replicated there already) has an
``unreduced`` cotangent, each device's partial sum. The loop carries those
partials, and one :func:`jax.sharding.reshard` to the parameter's sharding
after it is the reduction (an all-reduce, or a reduce-scatter for a
parameter sharded over data axes). Per parameter leaf:

* *reduced* (the default): held whole, typed reduced over the data axes;
  its sum is unreduced. With ``gather_params="every_microbatch"`` a
  parameter sharded over data axes is held as its shard and gathered (to
  reduced) inside the loop, for each micro-batch; with
  ``gradient_sync="every_microbatch"`` each micro-batch's weighted gradient
  is reduce-scattered over those axes into a sum sharded like it and
  unreduced over the other data axes (HSDP).
  With both policies ``"every_microbatch"`` a leaf sharded over every data
  axis goes to ``loss_fn`` as its shard on TPU and GPU
  (``shards_to_loss``, :func:`typed_trace.hands_shards_on`), as in the
  plain ``lax.scan`` of ``jax.grad`` a user would write: the model gathers
  it where it uses it, JAX reduce-scatters its gradient in the backward
  pass, and XLA may gather it again there rather than hold it whole from
  the forward pass (a lower peak: ``docs/performance.md``, "FSDP"). Only
  where the loss
  takes shards (else, the first trace raising, they are gathered as above),
  without ``with_stats`` (which reads each device's partial), and where the
  sum's dtype is the leaf's (else the reduce-scatter would run narrower).
* *replicated*: leaves that JAX cannot type reduced in the model as written
  (see :mod:`reduced_fallbacks`) and "max"/"last" leaves (whose rule needs
  each micro-batch's whole value). JAX reduces their gradient inside the
  loop, for each micro-batch; their sum is an ordinary replicated array.

Which leaves are reduced is decided by :func:`typed_trace.build_typed`,
from one trace of the call. The weighted add runs on each device's own
partials (:func:`collectives.add_to_partials`); the noise-scale sums of each
device's rows are :mod:`typed_noise`'s.
"""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import names
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import batching
from optax_accum._src.microbatch import fsdp
from optax_accum._src.microbatch import typed_noise
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


def _laid_out(x: Any, axis: int | None, axis_name: readers.AxisName) -> Any:
  """A batch leaf sharded over the data axes along ``axis`` (free)."""
  if axis is None:
    return x
  entries = readers.padded_entries(readers.full_spec(x), jnp.ndim(x))
  if entries[axis] is not None:
    return x  # forms.detect checked that these are the data axes.
  entries[axis] = axis_name
  return jax.sharding.reshard(x, P(*entries))


class TypedLayout(NamedTuple):
  """How the typed loop holds each parameter leaf and sums its gradient."""

  axis_name: readers.AxisName  # the data axes (Explicit, each of size > 1).
  treedef: Any  # the parameters' structure.
  targets: list[P]  # per leaf: the gradient's spec (the parameter's).
  reduced: list[bool]  # per leaf: cast reduced (else kept replicated).
  means: list[bool]  # per leaf: summed ("mean"): the noise scale's leaves.
  policy: fsdp.Policy
  leaf_axes: list[int | None]  # the batch leaves' split axes.
  device_axis: None = None  # loss_fn sees the global micro-batch.
  num_devices: int = 1
  # The leaves that loss_fn takes as shards (docstring above).
  shards_to_loss: frozenset[int] = frozenset()

  # Per leaf: how it is held and summed.

  def _data(self) -> frozenset[str]:
    return frozenset(readers.axes_of(self.axis_name))

  def _whole_spec(self, i: int, ndim: int, *, reduced: bool) -> P:
    """Leaf ``i`` held whole over the data axes (its model axes kept)."""
    entries = readers.drop_axes(self.targets[i],
                                readers.axes_of(self.axis_name), ndim)
    return P(*entries, reduced=self._data() if reduced else frozenset())

  def _sharded(self, i: int) -> bool:
    return bool(readers.data_axes_in(self.targets[i], self.axis_name))

  def _gathers_in_loop(self, i: int) -> bool:
    return self.policy.gathers_in_loop(self.reduced[i] and self._sharded(i))

  def _syncs_in_loop(self, i: int) -> bool:
    return self.policy.syncs_in_loop(self.reduced[i] and self._sharded(i))

  def can_hand_shard(self, i: int) -> bool:
    """Whether leaf ``i`` may go to ``loss_fn`` as its shard: gathered and
    synced in the loop, and sharded over every data axis."""
    return (self._gathers_in_loop(i) and self._syncs_in_loop(i)
            and set(readers.data_axes_in(self.targets[i], self.axis_name))
            == self._data())

  def _unreduced_over_rest(self, i: int) -> P:
    """Sharded like the parameter, unreduced over the other data axes."""
    rest = self._data() - set(
        readers.data_axes_in(self.targets[i], self.axis_name))
    return P(*readers.partitions(self.targets[i]), unreduced=rest)

  def _whole_partial(self, i: int, ndim: int) -> P:
    """A whole gradient's type: unreduced over every data axis."""
    entries = readers.drop_axes(self.targets[i],
                                readers.axes_of(self.axis_name), ndim)
    return P(*entries, unreduced=self._data())

  def _sum_spec(self, i: int, ndim: int) -> P:
    """The spec of leaf ``i``'s running sum in the loop's carry."""
    if not self.reduced[i]:
      return self._whole_spec(i, ndim, reduced=False)
    if self._syncs_in_loop(i):
      return self._unreduced_over_rest(i)
    return self._whole_partial(i, ndim)

  def _leaves(self, tree: Any) -> list[Any]:
    return self.treedef.flatten_up_to(tree)

  # The micro-batch loop.

  def split(self, batch, num_microbatches):
    """The batch laid out over the data axes (a replicated batch is sliced,
    without communication), then split."""
    leaves, treedef = jax.tree.flatten(batch)
    batch = treedef.unflatten([_laid_out(x, a, self.axis_name)
                               for x, a in zip(leaves, self.leaf_axes)])
    return batching.split(batch, None, num_microbatches,
                          sharded_layout_for_auto=False,
                          known_axes=self.leaf_axes)

  def device_local(self, tree):
    return tree

  def hold(self, params):
    """Whole parameters (reduced), or shards gathered in the loop; the
    others are gathered here, once, if sharded over data axes."""
    out = []
    for i, p in enumerate(self._leaves(params)):
      if self._gathers_in_loop(i):
        out.append(jax.sharding.reshard(p, self.targets[i]))
      else:
        out.append(jax.sharding.reshard(
            p, self._whole_spec(i, jnp.ndim(p), reduced=self.reduced[i])))
    return self.treedef.unflatten(out)

  def for_microbatch(self, held, index):
    """Shards gathered in the loop pass an optimization barrier with
    ``index``, so that XLA does not hoist their gathers (nor the model's,
    for the shards handed to ``loss_fn``)."""
    leaves = self._leaves(held)

    def whole(i, shard):
      if i in self.shards_to_loss:
        return shard
      return jax.sharding.reshard(
          shard, self._whole_spec(i, jnp.ndim(shard), reduced=True))

    return self.treedef.unflatten(fsdp.gathered_in_loop(
        leaves, [self._gathers_in_loop(i) for i in range(len(leaves))], index,
        whole))

  def zero_grads(self, held, dtypes):
    leaves = self._leaves(held)
    return self.treedef.unflatten([
        jnp.zeros(jnp.shape(p), dtype,
                  out_sharding=self._sum_spec(i, jnp.ndim(p)))
        for i, (p, dtype) in enumerate(zip(leaves, self._leaves(dtypes)))
    ])

  def _as_partial(self, g: Any, i: int) -> Any:
    """Leaf ``i``'s gradient typed unreduced over the data axes.

    A gradient that JAX already reduced (of a parameter the loss does not
    use) is cast: its value on one device, zeros on the others.
    """
    spec = self._whole_partial(i, jnp.ndim(g))
    if readers.full_spec(g) == spec:
      return g
    return compat.cast_unreduced(g, spec)

  def add_grads(self, total, grads, c, rules):
    """Replicated leaves follow their rule (:mod:`grad_reduction`);
    unreduced ones are weighted on each device's own partial. Under
    ``gradient_sync="every_microbatch"`` a sharded parameter's weighted
    partial is reduce-scattered into its sum."""
    sums, grads = self._leaves(total), self._leaves(grads)
    rules = [grad_reduction_lib.MEAN] * len(sums) if rules is None else rules
    out = list(sums)
    local = []  # (leaf, partial gradient, what it is added to)
    for i, (s, g) in enumerate(zip(sums, grads)):
      if i in self.shards_to_loss:  # reduce-scattered by JAX: a barrier
        # keeps XLA from moving it out of the loop with its add.
        out[i] = s + lax.optimization_barrier(
            token_weighting.weighted(g, c, s.dtype))
        continue
      if not self.reduced[i]:
        out[i] = grad_reduction_lib.add_by_rule(s, g, c, [rules[i]])
        continue
      g = self._as_partial(g, i)
      base = s if not self._syncs_in_loop(i) else jnp.zeros(
          jnp.shape(g), s.dtype, out_sharding=readers.full_spec(g))
      local.append((i, g, base))
    if local:
      new = collectives.add_to_partials(
          lambda gs, bs, c: [b + token_weighting.weighted(g, c, b.dtype)
                             for g, b in zip(gs, bs)],
          [g for _, g, _ in local], [b for _, _, b in local], c)
      scattered = {i: collectives.reduce_scatter_unreduced(
          value, readers.full_spec(sums[i]))
                   for (i, _, _), value in zip(local, new)
                   if self._syncs_in_loop(i)}
      # An optimization barrier between each reduce-scatter and its add, so
      # that XLA's TPU compiler cannot move them out of the loop (summing
      # whole partials through it, the memory the policy saves). Only for
      # shards left unreduced over no axis: jax 0.9's barrier loses the sum
      # of one still unreduced over other data axes (HSDP), counted once per
      # device of those axes.
      pin = [i for i, x in scattered.items() if not readers.unreduced_axes(x)]
      scattered.update(zip(pin, lax.optimization_barrier(
          [scattered[i] for i in pin])))
      for (i, _, _), value in zip(local, new):
        out[i] = sums[i] + scattered[i] if i in scattered else value
    return self.treedef.unflatten(out)

  # The noise scale: two groups of leaves (docs/noise_scale.md).

  def _groups(self) -> list[list[int]]:
    """The reduced leaves, then the summed replicated ones (fallbacks):
    each group that has leaves."""
    reduced = [i for i, r in enumerate(self.reduced) if r and self.means[i]]
    kept = [i for i, r in enumerate(self.reduced)
            if not r and self.means[i]]
    return [g for g in (reduced, kept) if g]

  def zero_stats(self):
    return [noise_scale.zero_sums() for _ in self._groups()]

  def add_stats(self, stats, grads, c, loss_reduction, count_tokens,
                microbatch):
    """A reduced leaf's small batches are each device's rows of the
    micro-batch: its partial, weighted by the rows' tokens; a replicated
    leaf's is the micro-batch. Only scalars cross devices."""
    leaves = self._leaves(grads)
    out = []
    for group, sums in zip(self._groups(), stats):
      if self.reduced[group[0]]:
        out.append(typed_noise.add_device_rows(
            sums, [self._as_partial(leaves[i], i) for i in group], c,
            loss_reduction, count_tokens, microbatch, self.axis_name))
      else:
        out.append(noise_scale.add_sq_norms(sums, [leaves[i] for i in group], c,
                                   loss_reduction))
    return out

  def sq_norms(self, tree):
    leaves = self._leaves(tree)
    return [noise_scale.sq_norm([leaves[i] for i in group])
            for group in self._groups()]

  def after_loop(self, total, rules):
    del rules
    return total

  def reducible_in_loop(self):
    """None. A layer loop would slice an unreduced running sum, and JAX has
    no unreduced rule for ``dynamic_slice`` (jax 0.10.2)."""
    return [False] * len(self.targets)

  def sum_in_loop(self, running, g, c):
    raise AssertionError("the typed form reduces no leaf in a loop.")

  def reduces_only_after_loop(self):
    """Every leaf reduced after the loop (none replicated, none synced in
    it), and some reduced there (not a deferred sum of parameters sharded
    over no data axis)."""
    if not all(self.reduced) or any(
        self._syncs_in_loop(i) for i in range(len(self.reduced))):
      return False
    return (self.policy.gradient_sync != names.DEFERRED
            or any(self._sharded(i) for i in range(len(self.reduced))))

  def reduce(self, partials):
    """The one reduction: each sum resharded to its parameter's sharding.

    With ``gradient_sync="deferred"`` the sums are only reduce-scattered
    over the data axes that shard their parameter and stay unreduced over
    the others (a replicated sum is cast there, its value on one device).
    Loss, token counts, aux and model state are global values already.
    """
    deferred = self.policy.gradient_sync == names.DEFERRED

    def finished(i, s):
      if not deferred:
        if self.reduced[i] and not self._syncs_in_loop(i):
          return collectives.reduce_scatter_unreduced(s, self.targets[i])
        return jax.sharding.reshard(s, self.targets[i])
      if self.reduced[i]:  # a reduce-scatter over the axes that shard it.
        return collectives.reduce_scatter_unreduced(
            s, self._unreduced_over_rest(i))
      return compat.cast_unreduced(s, self._unreduced_over_rest(i))

    return partials._replace(grads=self.treedef.unflatten(
        [finished(i, s) for i, s in enumerate(self._leaves(partials.grads))]))

  # Gradient caching.

  def gather_rows(self, reps, batch):
    """The loss sees the whole batch's representations (and the whole
    batch) on every device, as under shard_map."""
    names = readers.axes_of(self.axis_name)
    return jax.tree.map(lambda x: jax.sharding.reshard(
        x, P(*readers.drop_axes(readers.full_spec(x), names, jnp.ndim(x)))),
        (reps, batch))

  def scatter_rows(self, cotangents, like):
    return [jax.sharding.reshard(t, readers.full_spec(r))
            for t, r in zip(cotangents, like)]

  def loss_params(self, held):
    """Held parameters as plain replicated ones (free: no data moves): the
    coupled loss's direct gradient is then reduced."""
    return self.treedef.unflatten([
        jax.sharding.reshard(
            p, self._whole_spec(i, jnp.ndim(p), reduced=False))
        for i, p in enumerate(self._leaves(held))
    ])

  def as_sums(self, tree):
    """A reduced leaf's gradient becomes unreduced, for free; one that JAX
    already reduced is cast, its value on one device."""
    return self.treedef.unflatten([
        self._as_partial(g, i) if self.reduced[i] else g
        for i, g in enumerate(self._leaves(tree))
    ])
