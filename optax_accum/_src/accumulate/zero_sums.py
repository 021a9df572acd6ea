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

from optax_accum._src.accumulate import emitting
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


def shard_specs(tree: Any, data_axes: tuple[str, ...]) -> Any:
  """Each leaf's ZeRO spec under the current mesh."""
  return zero.zero_specs(tree, data_axes)


def sharded(tree: Any, data_axes: tuple[str, ...]) -> Any:
  """``tree``'s leaves resharded to their shards (a slice of whole ones)."""
  return jax.tree.map(jax.sharding.reshard, tree,
                      shard_specs(tree, data_axes))


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


def init_state(zero: "ZeroSums", inner: Any, params: Any,
               accumulator_dtype: Any, with_stats: bool) -> Any:
  """``accumulate``'s first state: ``inner``'s state in shards, the running
  sums whole like the parameters (ZeRO-1) or in shards (ZeRO-2)."""
  check_mesh(zero.data_axes)
  state = state_lib.init_state(
      inner.init(sharded(params, zero.data_axes)), params, accumulator_dtype,
      None, with_stats)
  if zero.gradient_sync == EVERY_MICROBATCH:
    state = state._replace(grad_sum=sharded(state.grad_sum, zero.data_axes))
  return state


class ZeroSums(NamedTuple):
  """Under jit, the optimizer (and with ZeRO-2 the sum) on shards."""

  data_axes: tuple[str, ...]
  gradient_sync: str

  def add(self, updates, state, params, num_tokens, tokens, settings, value):
    if not typed_sums.is_typed(updates, state.grad_sum):
      # Reduced gradients: a sharded sum takes its slice of each.
      return sum_layout.SingleSums().add(updates, state, params, num_tokens,
                                         tokens, settings, value)
    if self.gradient_sync == ONCE:
      return typed_sums.TypedSums().add(updates, state, params, num_tokens,
                                        tokens, settings, value)
    return self._scatter_into_shards(updates, state, params, tokens,
                                     settings, value)

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

  def reduced(self, cycle: emitting.Cycle, rules) -> emitting.Cycle:
    del rules
    specs = shard_specs(cycle.grad_sum, self.data_axes)

    def to_shard(s, spec):
      if readers.unreduced_axes(s):  # ZeRO-1: the one reduce-scatter.
        return collectives.reduce_scatter_unreduced(s, spec)
      return jax.sharding.reshard(s, spec)  # a slice, or nothing.

    return cycle._replace(grad_sum=jax.tree.map(to_shard, cycle.grad_sum,
                                                specs))

  def summed_like(self, grads):
    specs = shard_specs(readers.summed_like(grads), self.data_axes)
    return jax.tree.map(
        lambda g, spec: jax.ShapeDtypeStruct(
            jnp.shape(g), jnp.result_type(g), sharding=spec),
        grads, specs)

  def check_emit(self, emit):
    del emit  # a jit-level value.

  def finish_updates(self, updates, grads):
    """The updates gathered to the gradients' (the parameters') sharding:
    one all-gather per update, in the emitting branch."""
    return jax.tree.map(
        lambda u, g: jax.sharding.reshard(u, readers.plain_spec(g)),
        updates, grads)


def note_for_matrices(e: Exception) -> None:
  e.add_note(
      "optax_accum: accumulate(shard_optimizer=...) runs inner on each"
      " device's shard of the mean gradient and of its state. An inner that"
      " multiplies whole matrices (Muon's orthogonalisation, Shampoo) cannot"
      " run on shards: leave shard_optimizer out for it (plain data"
      " parallelism), or shard the model's parameters instead (FSDP:"
      " docs/distributed.md).")

