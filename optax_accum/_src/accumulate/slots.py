"""The SLOTS form of :func:`optax_accum.accumulate`: a slot per device.

A state built with ``axis_name`` keeps each device's partial sums behind a
leading slot axis (:mod:`partial_sums`). Under plain jit, on gradients typed
unreduced over those axes, each call adds every device's partial to its own
slot inside a shard_map over the whole mesh (:func:`manual.on_own_partials`),
with no gradient-sized communication; the emitting branch reshards the slots
(:func:`unreduced_sums.sum_slots`).
"""

from typing import Any

import jax
import jax.numpy as jnp

from optax_accum._src.accumulate import emitting
from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import unreduced_sums
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers
from optax_accum._src.rules import token_weighting


def add_to_slots(updates: Any, state: Any, params: Any, tokens: jax.Array,
                 settings: microstep.UpdateSettings) -> microstep.MicroStep:
  """Adds a micro-step's unreduced gradients to the slots (no communication).

  Each device adds its own partial, weighted by the global ``tokens``, to
  its slot; the token count and the drop counts, the same on every device,
  go into device 0's slot only. The non-finite decision is global: one
  scalar reduction. ``should_skip`` runs under jit on the unreduced
  gradients and the state as they are.
  """
  axis_name = settings.axis_name
  skipped = microstep.skipped_on_partials(settings.should_skip, updates,
                                          state, params)

  def local(grads, sums, tokens, skipped, cycle_start):
    nonfinite = jnp.bool_(False)
    if settings.skip_nonfinite:
      bad = ~microstep.all_finite(grads) & (tokens != 0)
      nonfinite = token_weighting.is_bad_count(tokens) | (
          unreduced_sums.any_device(bad, axis_name))
    c = token_weighting.contribution(
        tokens, settings.loss_reduction, drop=nonfinite | skipped)
    grad_sum, token_count, nonfinite_count, skipped_count = sums
    own = lambda x: jnp.where(unreduced_sums.is_first_device(axis_name), x, 0)
    return (microstep.add_to_sum(grad_sum, grads, c, cycle_start, None),
            token_count + own(c.tokens),
            nonfinite_count + own(nonfinite.astype(jnp.int32)),
            skipped_count + own(skipped.astype(jnp.int32)))

  sums = (state.grad_sum, state.token_count, state.nonfinite_count,
          state.skipped_count)
  sums = manual.on_own_partials(
      local, (updates, sums, tokens, skipped, state.micro_step == 0),
      jax.tree.map(readers.full_spec, sums),
  )
  grad_sum, token_count, nonfinite_count, skipped_count = sums
  return microstep.MicroStep(
      grads=updates,
      leaf_rules=None,  # all "mean": check_partials_settings refuses others.
      cycle=emitting.Cycle(grad_sum, token_count, None),
      nonfinite_count=nonfinite_count,
      skipped_count=skipped_count,
  )
