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
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.mesh import collectives
from optax_accum._src.mesh import readers
from optax_accum._src.mesh import zero
from optax_accum._src.rules import grad_reduction as grad_reduction_lib

ONCE = "once"
EVERY_MICROBATCH = "every_microbatch"
CHOICES = (ONCE, EVERY_MICROBATCH)


class Zero(NamedTuple):
  """``accumulate``'s ZeRO settings, checked at construction."""

  data_axes: tuple[str, ...]
  gradient_sync: str


def check(shard_optimizer, gradient_sync, axis_name, with_stats,
          grad_reduction) -> Zero | None:
  """``shard_optimizer`` and ``gradient_sync``, checked together."""
  if gradient_sync not in CHOICES:
    raise ValueError(
        f"gradient_sync must be one of {CHOICES}, got {gradient_sync!r}.")
  if shard_optimizer is None:
    if gradient_sync != ONCE:
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


def init_state(settings: Zero, inner: Any, params: Any,
               accumulator_dtype: Any, with_stats: bool) -> Any:
  """``accumulate``'s first state: ``inner``'s state in shards, the running
  sums whole like the parameters (ZeRO-1) or in shards (ZeRO-2)."""
  check_mesh(settings.data_axes)
  state = state_lib.init_state(
      inner.init(sharded(params, settings.data_axes)), params,
      accumulator_dtype, None, with_stats)
  if settings.gradient_sync == EVERY_MICROBATCH:
    state = state._replace(
        grad_sum=sharded(state.grad_sum, settings.data_axes))
  return state


class ZeroSums(NamedTuple):
  """Under jit, the optimizer (and with ZeRO-2 the sum) on shards.

  ``base`` is the layout the gradients come in by (the typed form's for
  unreduced gradients, the single form's for reduced ones, which a sharded
  sum takes its slice of); ZeRO-2 scatters unreduced ones itself.
  ``shards``, a tree of specs like the sums, lays out the shards: those of
  an ``inner`` state that came sharded (:mod:`sharded_inner`), or where
  None those :func:`zero.zero_specs` gives.
  """

  data_axes: tuple[str, ...]
  gradient_sync: str
  base: Any  # typed_sums.TypedSums or local_sums.SingleSums.
  local: bool = False
  shards: Any = None

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    if self.gradient_sync == ONCE or self.base.local:
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

