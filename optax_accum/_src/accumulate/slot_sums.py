"""The slots form of :func:`optax_accum.accumulate`: a slot per device, by jit.

With one jit call per micro-batch (PyTorch DDP's ``no_sync`` loop), a
gradient typed *unreduced* over the data axes (``float32[...]{U:data}``,
:func:`optax_accum.value_and_grad` with ``gradient_sync="deferred"``) holds
each device's partial. :func:`optax_accum.accumulate` built with
``axis_name`` keeps such partials in per-device slots (a state laid out by
``tx.init`` under the mesh, an ordinary sharded array that checkpoints and
:func:`optax_accum.state_partition_specs` handle). Each call adds every
device's partial to its own slot on each device's blocks
(:func:`manual.on_own_partials`), with no gradient-sized communication;
the emitting branch reshards the slots (:func:`sum_slots`), the one
reduction per update.

A parameter sharded over some of the data axes (FSDP, HSDP) gets its
gradient reduce-scattered over those axes each call; its slots span only the
remaining data axes (:func:`slot_axes`).
"""

from collections.abc import Sequence
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers


def slot_axes(param_spec: P | None,
              axis_name: readers.AxisName) -> tuple[str, ...]:
  """The data axes a parameter's gradient stays unreduced over.

  Those of ``axis_name`` that do not shard the parameter: over the others
  its gradient is reduce-scattered on every call.
  """
  used = set(readers.spec_names(param_spec or P()))
  return tuple(a for a in readers.axes_of(axis_name) if a not in used)


def slots_like(param: Any, dtype: Any, axis_name: readers.AxisName) -> Any:
  """A parameter's per-device slots under a mesh, sharded like it.

  The leading slot axis spans :func:`slot_axes`; the other dimensions keep
  the parameter's (Explicit) sharding.
  """
  spec = readers.explicit_spec(param) or P()
  over = slot_axes(spec, axis_name)
  sizes = readers.axis_sizes(jax.sharding.get_abstract_mesh())
  slots = math.prod(sizes[a] for a in over)
  entries = list(spec) + [None] * (jnp.ndim(param) - len(spec))
  return jnp.zeros(
      (slots,) + jnp.shape(param), dtype,
      out_sharding=P(readers.entry(over), *entries),
  )


def zeros_with_slot(shape: Sequence[int], dtype: Any,
                    axis_name: readers.AxisName) -> jax.Array:
  """Zeros for per-device partial sums: ``shape`` behind a leading slot axis.

  Inside shard_map or pmap each device has one slot. Under a mesh
  (:func:`jax.set_mesh`) with ``axis_name`` the slot axis has one slot per
  device and is sharded over it, ready for the ``in_specs`` that
  :func:`optax_accum.state_partition_specs` gives. With neither, one slot:
  replicate it for pmap.
  """
  shape = tuple(shape)
  slots = (None if axes.is_bound(axis_name)
           else readers.mesh_axis_size(axis_name))
  if slots is None:
    return jnp.zeros((1,) + shape, dtype)
  spec = P(axis_name)
  if readers.all_explicit(axis_name):
    return jnp.zeros((slots,) + shape, dtype, out_sharding=spec)
  return lax.with_sharding_constraint(jnp.zeros((slots,) + shape, dtype), spec)


def slots_sharded_by_type(axis_name: readers.AxisName) -> bool:
  """Whether :func:`zeros_with_slot` lays slots out over Explicit mesh axes."""
  return (not axes.is_bound(axis_name)
          and readers.mesh_axis_size(axis_name) is not None
          and readers.all_explicit(axis_name))


def init_slots(inner: Any, params: Any,
               settings: sum_layout.UpdateSettings) -> sum_layout.Start:
  """The first state with ``axis_name`` (the slots and the manual forms):
  each running sum this device's partial, behind a leading slot axis, so
  that no device's partial sum can be dropped (scalars included)."""
  axis_name = settings.axis_name
  inner_state = inner.init(params)
  by_type = slots_sharded_by_type(axis_name)

  def sum_zeros(param, dtype):
    if by_type:
      # Under a mesh with Explicit axes: slots sharded like the parameter,
      # ready for unreduced gradients under jit (and for shard_map).
      return slots_like(param, dtype, axis_name)
    return zeros_with_slot(jnp.shape(param), dtype, axis_name)

  grad_sum = sum_layout.unreduced_where_flax_shards(
      sum_layout.sums_like(params, settings, sum_zeros), params)
  return sum_layout.start(inner_state, grad_sum, settings,
                          lambda dtype: zeros_with_slot((), dtype, axis_name))


def _slot_spec(slots: Any) -> P:
  """The spec of a slot-holding state leaf, from its type."""
  spec = readers.explicit_spec(slots)
  if spec is None or (spec[0] is None and jnp.shape(slots)[0] != 1):
    raise ValueError(
        "The state's running sums are not laid out one slot per device:"
        " call tx.init(params) under jax.set_mesh(mesh) with Explicit axes"
        " (and, for sharded parameters, on parameters carrying their"
        f" sharding), got a sum typed {jax.typeof(slots)}."
    )
  return spec


def check_unreduced_over_slots(grads: Any, grad_sum: Any,
                               axis_name: readers.AxisName,
                               looked_at: bool) -> None:
  """Each gradient must be unreduced over exactly its slots' axes.

  A gradient that is already reduced (replicated) would be added on every
  device, counted once per device: refused. ``looked_at`` is False for a
  flush (``num_tokens=0``), whose zeros are never added.
  """
  if (readers.mesh_axis_size(axis_name) is None
      or not readers.all_explicit(axis_name)):
    axes.check_bound(axis_name)  # raises, saying where it works.
  flat = jax.tree_util.tree_leaves_with_path(grads)
  for (path, g), s in zip(flat, jax.tree.leaves(grad_sum)):
    spec = _slot_spec(s)
    want = frozenset(readers.axes_of(spec[0]) if spec[0] is not None else ())
    have = readers.unreduced_axes(g)
    if have == want or (not looked_at and not have):
      continue
    where = f"updates{jax.tree_util.keystr(path)}"
    if not have:
      raise ValueError(
          f"{where} is not unreduced over {sorted(want)} (its type is"
          f" {jax.typeof(g)}): under jax.jit, accumulate(axis_name="
          f"{axis_name!r}) takes per-device partial gradients, and would"
          " count an already reduced gradient once per device. Take the"
          " gradient with optax_accum.value_and_grad(..., axis_name="
          f"{axis_name!r}, gradient_sync='deferred'), call tx.update inside"
          " jax.shard_map on device-local gradients, or build accumulate"
          " with axis_name=None for reduced gradients."
      )
    raise ValueError(
        f"{where} is unreduced over {sorted(have)}, but the state keeps its"
        f" per-device sums over {sorted(want)} (accumulate(axis_name="
        f"{axis_name!r}) and the parameter's sharding): give accumulate the"
        " axis_name that value_and_grad's gradient_sync='deferred' used."
    )


def sum_slots(slots: Any) -> Any:
  """The sum over a leaf's slots, sharded like its parameter.

  Viewing the slots as one unreduced array is free; the reshard to the
  parameter's sharding is the reduction (an all-reduce, or nothing for a
  parameter sharded over every data axis).
  """
  spec = _slot_spec(slots)
  over = frozenset(readers.axes_of(spec[0]) if spec[0] is not None else ())
  rest = P(*spec[1:])
  if not over:
    return slots.reshape(slots.shape[1:])
  unreduced = manual.on_own_partials(
      lambda s: s.reshape(s.shape[1:]), (slots,),
      P(*readers.partitions(rest), unreduced=over),
  )
  return jax.sharding.reshard(unreduced, rest)


def add_to_slots(updates: Any, state: Any, params: Any, tokens: jax.Array,
                 settings: sum_layout.UpdateSettings,
                 value: jax.Array | None) -> sum_layout.MicroStep:
  """Adds a micro-step's unreduced gradients to the slots (no communication).

  Each device adds its own partial, weighted by the global ``tokens``, to
  its slot; the token count, the drop counts and ``value``'s sums, the same
  on every device, go into device 0's slot only. The non-finite decision is
  global: one scalar reduction. ``should_skip`` runs under jit on the unreduced
  gradients and the state as they are.
  """
  axis_name = settings.axis_name
  skipped = microstep.skipped_on_partials(settings.should_skip, updates,
                                          state, params)

  def local(grads, sums, tokens, skipped, cycle_start, value):
    grad_sum, token_count, nonfinite_count, skipped_count, value_sums = sums
    leaves, treedef = jax.tree.flatten(grad_sum)
    added = microstep.add_on_device(
        treedef.flatten_up_to(grads), leaves, tokens, skipped, cycle_start,
        settings, axis_name)
    # The counts are the same on every device: device 0's slot keeps them.
    own = lambda x: manual.on_first_device(x, axis_name)
    return (treedef.unflatten(added.sums),
            token_count + own(added.tokens),
            nonfinite_count + own(added.nonfinite.astype(jnp.int32)),
            skipped_count + own(skipped.astype(jnp.int32)),
            window_args.add(value_sums, value, own(added.kept_weight),
                            own(added.tokens)))

  sums = (state.grad_sum, state.token_count, state.nonfinite_count,
          state.skipped_count, state.value_sums)
  sums = manual.on_own_partials(
      local, (updates, sums, tokens, skipped, state.micro_step == 0, value),
      jax.tree.map(readers.full_spec, sums),
  )
  grad_sum, token_count, nonfinite_count, skipped_count, value_sums = sums
  return sum_layout.MicroStep(
      grads=updates,
      leaf_rules=None,  # all "mean": check_partials_settings refuses others.
      cycle=sum_layout.Cycle(grad_sum, token_count, None, value_sums),
      nonfinite_count=nonfinite_count,
      skipped_count=skipped_count,
  )


class SlotSums(NamedTuple):
  """Under jit, a state laid out with ``axis_name``: a slot per device."""

  axis_name: readers.AxisName
  local: bool = False

  def init(self, inner, params, settings):
    return init_slots(inner, params, settings)

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    microstep.check_partials_settings(incoming.grads, settings)
    grads = microstep.checked_grads(incoming.grads, state.grad_sum, None,
                                    slot_axis=True)
    check_unreduced_over_slots(grads, state.grad_sum, self.axis_name,
                               looked_at=not microstep.has_no_tokens(
                                   incoming.num_tokens))
    return add_to_slots(grads, state, params, incoming.tokens, settings,
                        incoming.value)

  def reduced(self, cycle, rules):
    del rules
    return sum_layout.Cycle(
        grad_sum=jax.tree.map(sum_slots, cycle.grad_sum),
        token_count=jnp.sum(cycle.token_count),
        stats_sums=None,
        value_sums=jax.tree.map(jnp.sum, cycle.value_sums),
    )

  def check_emit(self, emit):
    del emit
