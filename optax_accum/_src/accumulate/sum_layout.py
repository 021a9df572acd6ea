"""Where :func:`optax_accum.accumulate`'s running sums live: the Protocol.

Where a cycle's running sum lives, and so how a micro-step is added to it
and how the emitting branch reduces it, depends on where ``update`` runs and
on what it is given. ``accumulate`` decides it once per ``update`` call
(``transform.detect``) and holds one :class:`SumLayout`; nothing below asks
again. Each form's layout lives beside its own logic:

======== ============================================ =========================
form     when                                         the running sum
======== ============================================ =========================
single   no ``axis_name``, gradients reduced          one array like the param
         (:class:`SingleSums`, here)
manual   ``axis_name`` bound (shard_map, pmap)        this device's slot, psum
         (:mod:`manual_sums`)                         on emit
typed    under jit, gradients typed unreduced         unreduced like the
         (:mod:`typed_sums`)                          gradient, reduced on emit
slots    under jit, a state built with ``axis_name``  a slot per device,
         (:mod:`slot_sums`), unreduced gradients      resharded on emit
ZeRO     under jit, ``shard_optimizer`` given         typed's (ZeRO-1), or in
         (:mod:`zero_sums`)                           shards (ZeRO-2)
======== ============================================ =========================
"""

from typing import Any, NamedTuple, Protocol

import jax

from optax_accum._src.accumulate import emitting
from optax_accum._src.accumulate import microstep


class SumLayout(Protocol):
  """Where a cycle's sums live: one implementation per form."""

  def add(self, updates: Any, state: Any, params: Any, num_tokens: Any,
          tokens: jax.Array, settings: microstep.UpdateSettings,
          value: jax.Array | None) -> microstep.MicroStep:
    """Checks a micro-step's gradients and adds them (and ``value``, a
    replicated or device-local scalar, or None) to the running sums."""

  def reduced(self, cycle: emitting.Cycle,
              rules: list[str] | None) -> emitting.Cycle:
    """The sums over every device: the one reduction, when emitting."""

  def summed_like(self, grads: Any) -> Any:
    """``grads`` as the reduced mean will be typed (for shapes only)."""

  def check_emit(self, emit: jax.Array) -> None:
    """Checks a traced ``emit`` (the same on every device where needed)."""

  def finish_updates(self, updates: Any, grads: Any) -> Any:
    """``inner``'s updates as ``update`` returns them (in the emitting
    branch), laid out like ``grads``: the updates as they are, except
    ZeRO's (:mod:`zero_sums`), which gathers its shards."""


def as_computed(updates: Any, grads: Any) -> Any:
  """:meth:`SumLayout.finish_updates` of every form but ZeRO's."""
  del grads
  return updates


class SingleSums(NamedTuple):
  """No data axis: the gradients are whole, the sum one array."""

  def add(self, updates, state, params, num_tokens, tokens, settings, value):
    updates = microstep.checked_grads(updates, state.grad_sum, num_tokens)
    return microstep.add_local(updates, state, params, tokens, settings,
                               value)

  def reduced(self, cycle, rules):
    del rules
    return cycle

  def summed_like(self, grads):
    return grads

  def check_emit(self, emit):
    del emit

  finish_updates = staticmethod(as_computed)
