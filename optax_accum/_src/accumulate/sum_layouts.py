"""The forms of :func:`optax_accum.accumulate`, decided once per call.

Where a cycle's running sum lives, and so how a micro-step is added to it
and how the emitting branch reduces it, depends on where ``update`` runs and
on what it is given. :func:`detect` decides it once per ``update`` call and
returns a :class:`SumLayout`; nothing below asks again.

======== ============================================ =========================
form     when                                         the running sum
======== ============================================ =========================
SINGLE   no ``axis_name``, gradients reduced          one array like the param
MANUAL   ``axis_name`` bound (shard_map, pmap)        this device's slot, psum
                                                      on emit
TYPED    under jit, gradients typed unreduced         unreduced like the
         (``gradient_sync="deferred"``)               gradient, reshard on emit
SLOTS    under jit, a state built with ``axis_name``  a slot per device,
         (laid out at ``init``), unreduced gradients  resharded on emit
======== ============================================ =========================

``init`` lays out slots only when ``axis_name`` is given (MANUAL, and SLOTS
for states made that way under a mesh); without it the sum is shaped and
sharded like its parameter, which is all the TYPED form needs: its type
follows the gradients' from the first call on.
"""

import enum
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from optax_accum._src import validation
from optax_accum._src.accumulate import emitting
from optax_accum._src.accumulate import incoming_grads
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import partial_sums
from optax_accum._src.accumulate import slots
from optax_accum._src.accumulate import typed
from optax_accum._src.accumulate import unreduced_sums
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib


class Form(enum.Enum):
  SINGLE = "single"
  MANUAL = "manual"
  TYPED = "typed"
  SLOTS = "slots"


class SumLayout(Protocol):
  """Where a cycle's sums live: one implementation per :class:`Form`."""

  form: Form

  def add(self, updates: Any, state: Any, params: Any, num_tokens: Any,
          tokens: jax.Array,
          settings: microstep.UpdateSettings) -> microstep.MicroStep:
    """Checks a micro-step's gradients and adds them to the running sums."""

  def reduced(self, cycle: emitting.Cycle,
              rules: list[str] | None) -> emitting.Cycle:
    """The sums over every device: the one reduction, when emitting."""

  def summed_like(self, grads: Any) -> Any:
    """``grads`` as the reduced mean will be typed (for shapes only)."""

  def check_emit(self, emit: jax.Array) -> None:
    """Checks a traced ``emit`` (the same on every device where needed)."""


class Single(NamedTuple):
  """No data axis: the gradients are whole, the sum one array."""

  form: Form = Form.SINGLE

  def add(self, updates, state, params, num_tokens, tokens, settings):
    updates = incoming_grads.checked_grads(updates, state.grad_sum, None,
                                           num_tokens)
    return microstep.add_local(updates, state, params, tokens, settings)

  def reduced(self, cycle, rules):
    del rules
    return cycle

  def summed_like(self, grads):
    return grads

  def check_emit(self, emit):
    del emit


class Manual(NamedTuple):
  """A manual axis (shard_map, pmap): each device's slot, a psum on emit."""

  axis_name: readers.AxisName
  form: Form = Form.MANUAL

  def add(self, updates, state, params, num_tokens, tokens, settings):
    updates = incoming_grads.checked_grads(updates, state.grad_sum,
                                           self.axis_name, num_tokens)
    return microstep.add_local(updates, state, params, tokens, settings)

  def reduced(self, cycle, rules):
    # The "max" leaves get their pmax first, on one device, so that the one
    # sum that follows leaves them as they are.
    cycle = cycle._replace(grad_sum=grad_reduction_lib.max_over_devices(
        cycle.grad_sum, rules, self.axis_name, keep_on_one_device=True))
    cycle = partial_sums.sum_partials(cycle, self.axis_name)
    return cycle._replace(token_count=cycle.token_count.reshape(()))

  def summed_like(self, grads):
    return partial_sums.like_summed(grads, self.axis_name)

  def check_emit(self, emit):
    validation.check_same_on_every_device("emit", emit, self.axis_name)


class Typed(NamedTuple):
  """Under jit, unreduced gradients: the sum kept unreduced, by type."""

  form: Form = Form.TYPED

  def add(self, updates, state, params, num_tokens, tokens, settings):
    del num_tokens
    updates = typed.checked(updates, state.grad_sum)
    microstep.check_partials_settings(updates, settings)
    return typed.add(updates, state, params, tokens, settings)

  def reduced(self, cycle, rules):
    del rules
    return typed.reduced(cycle)

  def summed_like(self, grads):
    return readers.summed_like(grads)

  def check_emit(self, emit):
    del emit  # a jit-level value: the same on every device by its type.


class Slots(NamedTuple):
  """Under jit, a state laid out with ``axis_name``: a slot per device."""

  axis_name: readers.AxisName
  form: Form = Form.SLOTS

  def add(self, updates, state, params, num_tokens, tokens, settings):
    microstep.check_partials_settings(updates, settings)
    updates = incoming_grads.checked_partials(
        updates, state.grad_sum, self.axis_name, num_tokens)
    return slots.add_to_slots(updates, state, params, tokens,
                                       settings)

  def reduced(self, cycle, rules):
    del rules
    return emitting.Cycle(
        grad_sum=jax.tree.map(unreduced_sums.sum_slots, cycle.grad_sum),
        token_count=jnp.sum(cycle.token_count),
        stats_sums=None,
    )

  def summed_like(self, grads):
    return readers.summed_like(grads)

  def check_emit(self, emit):
    del emit


def detect(axis_name: readers.AxisName | None, updates: Any,
           grad_sum: Any) -> SumLayout:
  """The form of one ``update`` call (at trace time)."""
  if axis_name is None:
    if typed.is_typed(updates, grad_sum):
      return Typed()
    return Single()
  if axes.is_bound(axis_name):
    return Manual(axis_name)
  # axis_name under jit: init laid the state out in slots.
  return Slots(axis_name)
