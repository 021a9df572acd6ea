"""The two forms whose sums each device holds itself: single and manual.

*single*: no data axis; the gradients are whole and the sum one array like
its parameter. *manual*: inside :func:`jax.shard_map` or :func:`jax.pmap`,
with ``axis_name`` bound, each device keeps the sum of its own micro-batches'
gradients (its *partial sum*), and the partial sums are added over the axis
once, when the update is made. In the state a partial sum sits behind a
leading *slot* axis: one slot per device, so that a shard_map whose specs lay
the slots out over the axis keeps every device's partial sum (a replicated
spec would keep one and drop the others): :func:`slot_sums.init_slots`
lays them out.
"""

from typing import Any, NamedTuple

import jax
from jax import lax

from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import compat
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib


class SingleSums(NamedTuple):
  """No data axis: the gradients are whole, the sum one array."""

  local: bool = True

  def init(self, inner, params, settings):
    return sum_layout.whole(inner.init(params), params, settings)

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    grads = microstep.checked_grads(incoming.grads, state.grad_sum,
                                    incoming.num_tokens)
    return microstep.add_local(grads, state, params, incoming, settings)

  def reduced(self, cycle, rules):
    del rules
    return cycle

  def check_emit(self, emit):
    del emit


class ManualSums(NamedTuple):
  """A manual axis (shard_map, pmap): each device's slot, a psum on emit."""

  axis_name: readers.AxisName
  local: bool = False

  def init(self, inner, params, settings):
    return slot_sums.init_slots(inner, params, settings)

  def add(self, incoming: sum_layout.Incoming, state, params, settings):
    grads = microstep.checked_grads(incoming.grads, state.grad_sum,
                                    incoming.num_tokens, slot_axis=True,
                                    local_over=self.axis_name)
    return microstep.add_local(grads, state, params, incoming, settings)

  def reduced(self, cycle, rules):
    # The "max" leaves get their pmax first, on one device, so that the one
    # sum that follows leaves them as they are.
    cycle = cycle._replace(grad_sum=grad_reduction_lib.max_over_devices(
        cycle.grad_sum, rules, self.axis_name, keep_on_one_device=True))
    cycle = sum_slots_over(cycle, self.axis_name)
    return cycle._replace(token_count=cycle.token_count.reshape(()))

  def check_emit(self, emit):
    axes.check_same_on_every_device("emit", emit, self.axis_name)


def sum_slots_over(tree: Any, axis_name: readers.AxisName) -> Any:
  """Sums per-device partial sums (with a leading slot axis) over an axis."""
  axes.check_bound(axis_name)
  return compat.summed_in_float32(
      lambda t: lax.psum(t, axis_name),
      jax.tree.map(lambda x: x.reshape(x.shape[1:]), tree))
