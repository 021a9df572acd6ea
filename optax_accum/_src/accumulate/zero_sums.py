"""ZeRO-1 and ZeRO-2 in :func:`optax_accum.accumulate`, under jit.

``accumulate(inner, k, shard_optimizer=data_axes)`` keeps ``inner``'s state
sharded over the data axes (each leaf by :func:`zero.zero_specs`), while the
parameters stay as the model lays them out. Per update, the emitting branch
hands ``inner`` the window's mean on each device's shard, so that ``inner``
updates 1/N of each leaf, and gathers the updates back to the parameters'
sharding (one all-gather per update). How the gradients get to the shards
is ``gradient_sync``'s:

* ``"once"`` (ZeRO-1): the running sum is kept as the typed form keeps it
  (:mod:`typed_sums`: unreduced over the data axes, each device's partial,
  for ``gradient_sync="deferred"`` gradients) and is reduce-scattered into
  the shards on emit: one reduce-scatter per update, no all-reduce.
* ``"every_microbatch"`` (ZeRO-2): the running sum is sharded like the
  state, and each call reduce-scatters its weighted partial gradient into
  it: ``k`` reduce-scatters per update, 1/N of the sum's memory. A leaf
  that ``zero_specs`` keeps whole keeps the typed form's unreduced sum,
  all-reduced once, on emit.

Gradients that JAX already reduced (replicated over the data axes) are
sliced into the shards, which moves nothing.

*ZeRO by Flax.* An ``nnx.Optimizer`` whose Variables carry Flax's
``optimizer_sharding`` over axes that the parameters are replicated over
lays ``inner``'s state out in shards over them, with no argument of ours
(as does ``opt.init`` on resharded parameters in plain optax). Fed
``gradient_sync="deferred"`` gradients, unreduced over those axes,
``accumulate`` runs ZeRO-1 on those shards (:func:`sharded_by_inner`): the
running sum is each device's partial, whole, and the emitting branch
reduce-scatters it straight into the shards of ``inner``'s state (one
reduce-scatter per sharded leaf and update, no gradient-sized all-reduce);
the updates are gathered back to the parameters' layout
(``emit._laid_out_like``). ``tx.init`` lays the sums of such a tree out as
every update call leaves them
(:func:`sum_layout.unreduced_where_flax_shards`), so
that the state's type is the same before and after a call (one trace of
the step); Flax would otherwise shard them as the Variables say, and the
first call would change their layout.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src import names
from optax_accum._src import validation
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import readers
from optax_accum._src.mesh import zero
from optax_accum._src.rules import grad_reduction as grad_reduction_lib


class Zero(NamedTuple):
  """``accumulate``'s ZeRO settings, checked at construction."""

  data_axes: tuple[str, ...]
  gradient_sync: str


def check(shard_optimizer, gradient_sync, axis_name, with_stats,
          grad_reduction) -> Zero | None:
  """``shard_optimizer`` and ``gradient_sync``, checked together."""
  if gradient_sync not in names.CHOICES:
    raise ValueError(
        f"gradient_sync must be one of {names.CHOICES}, got {gradient_sync!r}.")
  if shard_optimizer is None:
    if gradient_sync != names.ONCE:
      raise ValueError(
          f"gradient_sync={gradient_sync!r} shards the running sum over the"
          " data axes that shard_optimizer names (ZeRO-2): pass"
          " shard_optimizer too, e.g. shard_optimizer='data'.")
    return None
  data_axes = validation.check_axis_name(shard_optimizer, "shard_optimizer")
  if axis_name is not None:
    raise ValueError(
        f"shard_optimizer={shard_optimizer!r} with axis_name={axis_name!r}:"
        " ZeRO runs under jax.jit, where the gradients' types say their"
        " axes; leave axis_name out (it is for jax.shard_map and jax.pmap).")
  if with_stats or grad_reduction is not None:  # None: all "mean".
    raise ValueError(
        f"shard_optimizer={shard_optimizer!r} takes neither with_stats nor a"
        " grad_reduction other than 'mean' (got with_stats="
        f"{with_stats!r}, grad_reduction={grad_reduction!r}).")
  return Zero(readers.axes_of(data_axes), gradient_sync)


def sharded(tree: Any, data_axes: tuple[str, ...]) -> Any:
  """``tree``'s leaves resharded to their shards (a slice of whole ones)."""
  return jax.tree.map(jax.sharding.reshard, tree,
                      zero.zero_specs(tree, data_axes))


def check_mesh(data_axes: tuple[str, ...]) -> None:
  """``shard_optimizer`` needs its axes, Explicit, in the current mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not readers.are_explicit(mesh, data_axes) or any(
      a not in mesh.axis_names for a in data_axes):
    raise ValueError(
        f"accumulate(shard_optimizer={data_axes!r}) lays out its state over"
        " those mesh axes: call tx.init and tx.update under"
        " jax.set_mesh(mesh), a mesh with those axes Explicit (got"
        f" {dict(zip(mesh.axis_names, mesh.axis_types)) or 'no mesh'}).")


class ZeroSums(NamedTuple):
  """Under jit, the optimizer (and with ZeRO-2 the sum) on shards.

  ``base`` is the layout the gradients come in by (the typed form's for
  unreduced gradients, the single form's for reduced ones, which a sharded
  sum takes its slice of); ZeRO-2 scatters unreduced ones itself.
  With ``by_inner``, ``inner``'s state comes in shards laid out by its
  caller (Flax's ``optimizer_sharding``), and ``shards``, a tree of specs
  like the sums read off that state at update, lays out the shards; else
  (``shard_optimizer``) ``init`` shards it, as :func:`zero.zero_specs`
  says.
  """

  data_axes: tuple[str, ...]
  gradient_sync: str
  base: Any  # typed_sums.TypedSums or local_sums.SingleSums.
  local: bool = False
  shards: Any = None
  by_inner: bool = False

  def init(self, inner, params, settings):
    """``inner``'s state in shards, the running sums whole like the
    parameters (ZeRO-1) or in shards (ZeRO-2)."""
    # By Flax, its Variables lay inner's state out in shards themselves.
    start = sum_layout.whole(inner.init(
        params if self.by_inner else sharded(params, self.data_axes)),
                             params, settings)
    grad_sum = start.cycle.grad_sum
    if self.gradient_sync == names.EVERY_MICROBATCH:
      grad_sum = sharded(grad_sum, self.data_axes)
    grad_sum = sum_layout.unreduced_where_flax_shards(
        grad_sum, params, () if self.by_inner else self.data_axes)
    return start._replace(cycle=start.cycle._replace(grad_sum=grad_sum))

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    if self.gradient_sync == names.ONCE or self.base.local:
      return self.base.add(incoming, state, params, settings)
    return self._scatter_into_shards(incoming.grads, state, params,
                                     incoming.tokens, settings,
                                     incoming.value)

  def _scatter_into_shards(self, updates, state, params, tokens, settings,
                           value):
    """ZeRO-2: this call's weighted partials, reduce-scattered into the
    sharded sum (the typed form's add, on zeros). A leaf that no data axis
    shards (:func:`zero.zero_specs` left it whole) keeps the typed form's
    unreduced sum instead, reduced once, on emit."""
    updates = microstep.checked_grads(updates, state.grad_sum, None)
    microstep.check_partials_settings(updates, settings)
    scattered = jax.tree.map(
        lambda s: bool(set(readers.spec_names(readers.plain_spec(s)))
                       & set(self.data_axes)), state.grad_sum)
    fresh = jax.tree.map(
        lambda s, g, scatter: jnp.zeros(
            jnp.shape(s), s.dtype, out_sharding=readers.plain_spec(g))
        if scatter else s,
        state.grad_sum, updates, scattered)
    step = typed_sums.add_partials(updates, state._replace(grad_sum=fresh),
                                   params, tokens, settings, value)
    start = state.micro_step == 0  # the lazy reset of a sharded sum.
    grad_sum = jax.tree.map(
        lambda s, c, scatter: grad_reduction_lib.restart(s, None, start)
        + collectives.reduce_scatter_unreduced(c, readers.plain_spec(s))
        if scatter else c,
        state.grad_sum, step.cycle.grad_sum, scattered)
    return step._replace(cycle=step.cycle._replace(grad_sum=grad_sum))

  def reduced(self, cycle: sum_layout.Cycle, rules) -> sum_layout.Cycle:
    del rules
    specs = self.shards
    if specs is None:
      specs = zero.zero_specs(cycle.grad_sum, self.data_axes)

    def to_shard(s, spec):
      if readers.unreduced_axes(s):  # ZeRO-1: the one reduce-scatter.
        return collectives.reduce_scatter_unreduced(s, spec)
      return jax.sharding.reshard(s, spec)  # a slice, or nothing.

    return cycle._replace(grad_sum=jax.tree.map(to_shard, cycle.grad_sum,
                                                specs))

  def check_emit(self, emit):
    del emit  # a jit-level value.


def note_for_matrices(e: Exception) -> None:
  e.add_note(
      "optax_accum: accumulate(shard_optimizer=...) runs inner on each"
      " device's shard of the mean gradient and of its state. An inner that"
      " multiplies whole matrices (Muon's orthogonalisation, Shampoo) cannot"
      " run on shards: leave shard_optimizer out for it (plain data"
      " parallelism), or shard the model's parameters instead (FSDP:"
      " docs/distributed.md).")


def _shaped_like(tree: Any, structure: Any, shapes: list[Any]) -> bool:
  return (jax.tree.structure(tree) == structure
          and [jnp.shape(x) for x in jax.tree.leaves(tree)] == shapes)


def _shard_of(leaf: int, over: frozenset[str],
              like_sums: list[list[Any]]) -> P | None:
  """The spec of the first state leaf shaped like sum ``leaf`` that shards
  it over some of ``over``, the axes the sum is unreduced over."""
  for leaves in like_sums:
    spec = readers.plain_spec(leaves[leaf])
    if set(readers.spec_names(spec)) & over:
      return spec
  return None


def sharded_by_flax(params: Any) -> "ZeroSums | None":
  """At ``init``: ZeRO-1 by Flax, where ``params``' Variables carry an
  ``optimizer_sharding`` over Explicit axes that do not shard them."""
  data_axes = sum_layout.flax_zero_axes(params)
  if not data_axes:
    return None
  return ZeroSums(tuple(sorted(data_axes)), names.ONCE, typed_sums.TypedSums(),
                  by_inner=True)


def sharded_by_inner(inner_state: Any, updates: Any,
                     grad_sum: Any) -> "ZeroSums | None":
  """At ``update``: ZeRO-1 on ``inner_state``'s shards, where some state
  leaf shaped like the sums (adam's moments) shards one over axes its sum
  or gradient is unreduced over; None where none does.

  Read off the state, not our settings: Flax's ``optimizer_sharding`` lays
  ``inner``'s state out in its caller's hands, after ``accumulate`` was
  made, and the state carries no mark of it but its shards."""
  overs = [readers.unreduced_axes(g) | readers.unreduced_axes(s)
           for g, s in zip(jax.tree.leaves(updates),
                           jax.tree.leaves(grad_sum))]
  if not any(overs):
    return None
  structure = jax.tree.structure(grad_sum)
  shapes = [jnp.shape(s) for s in jax.tree.leaves(grad_sum)]
  is_like = lambda t: _shaped_like(t, structure, shapes)
  like_sums = [jax.tree.leaves(t)
               for t in jax.tree.leaves(inner_state, is_leaf=is_like)
               if is_like(t)]
  shards = [_shard_of(i, over, like_sums) for i, over in enumerate(overs)]
  if all(spec is None for spec in shards):
    return None
  data_axes = tuple(sorted({a for spec, over in zip(shards, overs)
                            if spec is not None
                            for a in readers.spec_names(spec) if a in over}))
  specs = [readers.plain_spec(s) if spec is None else spec
           for s, spec in zip(jax.tree.leaves(grad_sum), shards)]
  return ZeroSums(data_axes, names.ONCE, typed_sums.TypedSums(),
                  shards=jax.tree.unflatten(structure, specs), by_inner=True)
