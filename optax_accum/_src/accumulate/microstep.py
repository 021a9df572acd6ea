"""One micro-step of :func:`optax_accum.accumulate`: what it adds, and why not.

Every form of ``accumulate`` adds a micro-step the same way: the incoming
gradients checked against the state (:func:`checked_grads`), the drop
decisions (``skip_nonfinite``, ``should_skip``), the token-weighted
contribution, and the lazy-reset add to the running sum. The forms differ
only in where the sum lives (one array, a device's slot, an unreduced array:
:mod:`local_sums`, :mod:`typed_sums`, :mod:`slot_sums`, :mod:`zero_sums`)
and so in how the add is run; the two deferred forms run theirs on each
device's own partials with :func:`add_on_device`.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_accum._src import validation
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.mesh import axes
from optax_accum._src.mesh import manual
from optax_accum._src.mesh import readers
from optax_accum._src.rules import grad_reduction as grad_reduction_lib
from optax_accum._src.rules import noise_scale
from optax_accum._src.rules import token_weighting


class DeviceAdd(NamedTuple):
  """What :func:`add_on_device` hands back, per device."""

  sums: list[Any]  # the new running sums, one per leaf.
  tokens: jax.Array  # shape=(), float32: the tokens counted (0 if dropped).
  nonfinite: jax.Array  # shape=(), bool: dropped by skip_nonfinite.
  kept_weight: jax.Array  # shape=(), float32: the weight added with; 0 if
  # nothing was added.


class Drops(NamedTuple):
  """Why a micro-step adds nothing."""

  nonfinite: jax.Array  # shape=(), bool: dropped by skip_nonfinite.
  skipped: jax.Array  # shape=(), bool: dropped by should_skip.


def all_finite(tree: Any) -> jax.Array:
  finite = jnp.bool_(True)
  for leaf in jax.tree.leaves(tree):
    finite &= jnp.all(jnp.isfinite(leaf))
  return finite


def increment_where(flag, counter):
  return jnp.where(flag, optax.safe_increment(counter), counter)


def skipped(should_skip, updates, state, params):
  """``should_skip``'s verdict, a bool scalar (False without one)."""
  if should_skip is None:
    return jnp.bool_(False)
  return validation.check_predicate(
      "should_skip(grads, state, params)", should_skip(updates, state, params)
  )


def skipped_on_partials(should_skip, updates, state, params):
  """``should_skip`` on unreduced gradients, JAX's error kept, with a hint."""
  try:
    return skipped(should_skip, updates, state, params)
  except (NotImplementedError, TypeError, ValueError) as e:
    e.add_note(
        "optax_accum: should_skip(grads, state, params) ran on unreduced"
        " gradients (each device's partial; JAX allows little arithmetic on"
        " them): decide from replicated values (the state's counts, the"
        " loss, a flag), or use skip_nonfinite=True for non-finite"
        " gradients."
    )
    raise


def drops(updates, tokens, state, params,
          settings: sum_layout.UpdateSettings) -> Drops:
  """Whether ``skip_nonfinite`` and ``should_skip`` drop this micro-step."""
  nonfinite = jnp.bool_(False)
  if settings.skip_nonfinite:
    # A micro-step without tokens adds nothing whatever its gradient (often
    # a 0/0 mean): it is not a dropped one.
    bad_grads = ~all_finite(updates) & (tokens != 0)
    nonfinite = token_weighting.is_bad_count(tokens) | bad_grads
  return Drops(nonfinite=nonfinite,
               skipped=skipped(settings.should_skip, updates, state, params))


def add_to_sum(grad_sum, updates, contribution, cycle_start, rules):
  """The running sum after this micro-step, with the lazy reset.

  The call that starts a cycle (``micro_step == 0``) adds to zeros instead of
  to the stored sum, which still holds the finished cycle's (or the updates
  that ``tx.update`` kept in its buffer: ``emit.UpdatesInSum``). Zeroing the sum
  in the emitting branch instead would make it an output of the
  ``lax.cond``, which XLA cannot write in place: every accumulator (and, on
  CPU, inner-state) buffer would then be copied on every micro-step. This way
  a non-emitting call is one fused in-place pass over the sum, and the
  conditional only reads it.
  """
  restarted = grad_reduction_lib.restart(grad_sum, rules, cycle_start)
  return grad_reduction_lib.add_by_rule(restarted, updates, contribution, rules)


def kept_weight(c: token_weighting.Contribution) -> jax.Array:
  """The weight a micro-step's gradient was added with; 0 if not added."""
  return jnp.where(c.keep, c.weight, jnp.zeros([], jnp.float32))


def cycle_after(state, grads, contribution, loss_reduction,
                rules, value) -> sum_layout.Cycle:
  """The running sums with this micro-step (and its ``value``) added."""
  stats_sums = state.stats_sums
  if stats_sums is not None:
    stats_sums = noise_scale.add_sq_norms(
        stats_sums, grad_reduction_lib.only_means(grads, rules), contribution,
        loss_reduction)
  return sum_layout.Cycle(
      grad_sum=add_to_sum(
          state.grad_sum, grads, contribution, state.micro_step == 0, rules
      ),
      token_count=state.token_count + contribution.tokens,
      stats_sums=stats_sums,
      value_sums=window_args.add(state.value_sums, value,
                                 kept_weight(contribution),
                                 contribution.tokens),
  )


def add_local(updates, state, params, incoming: sum_layout.Incoming,
              settings: sum_layout.UpdateSettings) -> sum_layout.MicroStep:
  """Adds checked gradients that this device holds whole (or device-local)."""
  dropped = drops(updates, incoming.tokens, state, params, settings)
  contribution = token_weighting.contribution(
      incoming.tokens, settings.loss_reduction,
      drop=dropped.nonfinite | dropped.skipped
  )
  leaf_rules = grad_reduction_lib.rules_per_leaf(settings.grad_reduction,
                                                 updates)
  return sum_layout.MicroStep(
      grads=updates,
      leaf_rules=leaf_rules,
      cycle=cycle_after(state, updates, contribution,
                        settings.loss_reduction, leaf_rules, incoming.value),
      nonfinite_count=increment_where(dropped.nonfinite,
                                      state.nonfinite_count),
      skipped_count=increment_where(dropped.skipped, state.skipped_count),
  )


_STATS_UNREDUCED = (
    "with_stats=True cannot estimate the noise scale from unreduced"
    " gradients (gradient_sync='deferred' under jax.jit): it needs each"
    " micro-step's reduced gradient norm, a gradient-sized reduction per"
    " call. Use with_stats inside jax.shard_map with device-local gradients"
    " and each device's own num_tokens, or oa.value_and_grad(...,"
    " with_stats=True) without gradient_sync='deferred'."
)


def add_on_device(grads: list[Any], sums: list[Any], tokens: jax.Array,
                  skip: jax.Array, cycle_start: jax.Array,
                  settings: sum_layout.UpdateSettings,
                  over: readers.AxisName) -> DeviceAdd:
  """Adds a device's partial gradients to its partial sums (the deferred
  forms' add, inside :func:`manual.on_own_partials`).

  ``tokens`` is the micro-step's global count (the same on every device);
  the non-finite decision is global over the devices of ``over`` (one
  scalar reduction), so that every device drops the same micro-step.
  """
  nonfinite = jnp.bool_(False)
  if settings.skip_nonfinite:
    bad = ~all_finite(grads) & (tokens != 0)
    nonfinite = token_weighting.is_bad_count(tokens) | manual.any_device(
        bad, over)
  c = token_weighting.contribution(tokens, settings.loss_reduction,
                                   drop=nonfinite | skip)
  return DeviceAdd(add_to_sum(sums, grads, c, cycle_start, None), c.tokens,
                   nonfinite, kept_weight(c))


def checked_grads(updates: Any, grad_sum: Any, num_tokens: Any, *,
                  slot_axis: bool = False,
                  local_over: readers.AxisName | None = None) -> Any:
  """The incoming gradients as floating arrays, checked against the state.

  Python scalars and NumPy arrays are accepted as optax accepts them. Each
  leaf must be shaped like its running sum (without the sum's leading slot
  axis where ``slot_axis``). With ``local_over`` the gradients must be
  device-local over those manual axes, unless the micro-step is known at
  trace time to have no tokens (a flush, ``num_tokens=0``: its zeros are
  never looked at).
  """
  start = 1 if slot_axis else 0
  expected = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(jnp.shape(s)[start:], s.dtype), grad_sum)
  validation.check_same_structure(
      "updates", updates, expected, "the params the state was built for")
  updates = jax.tree.map(jnp.asarray, updates)
  if local_over is not None and not has_no_tokens(num_tokens):
    axes.check_device_local("updates", updates, local_over)
  return as_inexact(updates, grad_sum)


def has_no_tokens(num_tokens: Any) -> bool:
  """Whether the micro-step is known at trace time to have no tokens."""
  return num_tokens is not None and not isinstance(
      num_tokens, jax.core.Tracer) and float(num_tokens) == 0


def as_inexact(grads: Any, grad_sum: Any) -> Any:
  """Gradients as floating (or complex) arrays, checked against the sum.

  Integer and bool leaves (a Python ``0`` for an unused parameter) take the
  sum's dtype, so that their mean is not rounded to an integer. A complex
  gradient for a real sum would lose its imaginary part: refused.
  """

  def convert(path, g, s):
    if jnp.iscomplexobj(g) and not jnp.iscomplexobj(s):
      raise TypeError(
          f"updates{jax.tree_util.keystr(path)} is complex ({g.dtype}) but"
          f" the parameters it is for are real (the sum is {s.dtype}): its"
          " imaginary part would be lost. Initialise with complex"
          " parameters."
      )
    if jnp.issubdtype(g.dtype, jnp.inexact):
      return g
    return g.astype(s.dtype)

  return jax.tree_util.tree_map_with_path(convert, grads, grad_sum)


def check_partials_settings(updates,
                            settings: sum_layout.UpdateSettings) -> None:
  """What unreduced gradients under jit cannot do, refused by name."""
  if settings.with_stats:
    raise ValueError(_STATS_UNREDUCED)
  leaf_rules = grad_reduction_lib.rules_per_leaf(settings.grad_reduction,
                                                 updates)
  if leaf_rules is not None and any(
      r != grad_reduction_lib.MEAN for r in leaf_rules):
    raise ValueError(
        f"grad_reduction={settings.grad_reduction!r} with unreduced"
        " gradients under jax.jit: a max over the devices' partial"
        " gradients is not the max of their sum. Use grad_reduction='mean'"
        " there, or accumulate inside jax.shard_map."
    )
