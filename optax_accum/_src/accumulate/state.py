"""The state of :func:`optax_accum.accumulate`: its fields, start and step.

Every field is an array (or a NamedTuple of arrays), so that the state
checkpoints, shards and crosses ``jax.jit`` as any optax state does.
"""

from typing import Any, NamedTuple
import weakref

import jax
import jax.numpy as jnp
import optax

from optax_accum._src.accumulate import microstep
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import window_args
from optax_accum._src.rules import noise_scale


class _Fields(NamedTuple):
  """The fields of :class:`AccumulateState` (its docstring says each)."""

  micro_step: jax.Array  # shape=(), dtype=jnp.int32.
  count: jax.Array  # shape=(), dtype=jnp.int32.
  grad_sum: optax.Updates  # like params, dtype=accumulator_dtype.
  token_count: jax.Array  # shape=() or (slots,), dtype=jnp.float32.
  inner_state: optax.OptState
  emitted: jax.Array  # shape=(), dtype=jnp.bool_.
  nonfinite_count: jax.Array  # shape=() or (slots,), dtype=jnp.int32.
  skipped_count: jax.Array  # shape=() or (slots,), dtype=jnp.int32.
  stats_sums: noise_scale.StatsSums | None  # float32 scalars or (slots,).
  stats: noise_scale.GradStats | None  # float32 scalars.
  tokens_seen: jax.Array  # shape=(), dtype=jnp.float32.
  tokens_seen_error: jax.Array  # shape=(), dtype=jnp.float32.
  value_sums: window_args.ValueSums  # scalars or (slots,).


# What other trainers call our fields (a port reads theirs first).
_OTHER_NAMES = {
    "gradient_step": "micro_step", "mini_step": "micro_step",
    "acc_grads": "grad_sum", "accumulated_grads": "grad_sum",
    "grad_acc": "grad_sum", "grads_acc": "grad_sum",
    "inner_opt_state": "inner_state", "opt_state": "inner_state",
    "num_tokens": "token_count", "tokens": "token_count",
    "skip_state": "nonfinite_count", "last_finite": "emitted",
    "step": "count",
}


class AccumulateState(_Fields):
  """State of :func:`accumulate`: the running sums and the wrapped state.

  With ``axis_name``, the fields marked *per device* hold each device's own
  partial value behind a leading slot axis of one slot per device (see
  :func:`optax_accum.state_partition_specs`); they are summed over the axis
  once per cycle, when it emits.

  Attributes:
    micro_step: micro-steps taken in the current cycle; 0 right after an emit.
    count: optimizer updates emitted so far (cycles that had tokens).
    grad_sum: the current cycle's running sum of token-weighted gradients,
      shaped like the parameters, in ``accumulator_dtype``; per device.
      Right after an emitting call (``micro_step == 0``) it holds no sum:
      its buffer is scratch that the next call overwrites instead of adding
      to (the reset is lazy: see ``microstep.add_to_sum`` for why). What
      the scratch holds is not part of the contract (today the finished
      cycle's sum, or the updates ``tx.update`` handed back, kept in that
      buffer rather than in one of their own). A leaf that
      ``grad_reduction`` reduces by "max" holds the running maximum (from
      ``-inf``), one by "last" the last kept gradient.
    token_count: the current cycle's running token count, float32; per
      device.
    inner_state: the state of the wrapped optimizer, advanced once per emit.
    emitted: whether the call that produced this state emitted an update
      (read it with :func:`optax_accum.has_updated`).
    nonfinite_count: micro-steps dropped by ``skip_nonfinite`` (a non-finite
      gradient, or a ``num_tokens`` that is NaN, infinite or negative) since
      ``init``; per device. A micro-step with zero tokens is not dropped (it
      adds nothing anyway): its NaN gradient, often a 0/0 mean, is not
      counted.
    skipped_count: micro-steps dropped by ``should_skip`` since ``init``; per
      device. A micro-step that both rules drop is counted by both.
    stats_sums: with ``with_stats``, the current cycle's running sums behind
      the noise scale's estimate (float32 scalars; per device); else None.
    stats: with ``with_stats``, the :class:`GradStats` of the last cycle that
      emitted (read them with :func:`optax_accum.grad_stats`); else None.
    tokens_seen: the tokens behind every update emitted since ``init``: the
      sum of the token counts that the updates' means divided by, over every
      device (read it with :func:`optax_accum.tokens_seen`); float32, the
      same on every device.
    tokens_seen_error: the rounding error of ``tokens_seen``'s running sum,
      carried into the next addition (Kahan summation), so that the count
      does not drift over billions of tokens; float32.
    value_sums: the current cycle's running sums behind the ``value`` that
      ``inner`` gets on emit (its token-weighted mean over the window; see
      ``update``'s extra arguments); per device.

  ``tx.update`` changes nothing it is given. The state it returns
  remembers (weakly, not as a leaf) the updates returned with it, so that
  :func:`optax_accum.apply_if_updated` names its parameters and updates
  passed swapped; that changes nothing any call computes.
  """

  def __getstate__(self):
    """Pickled and copied as its fields: the memory of the updates stays
    with the object."""
    return None

  def __getattr__(self, name):
    """A field of the inner optimizer's state, read through this one.

    ``state.hyperparams`` (``optax.inject_hyperparams``, also inside an
    ``optax.chain``), ``state.b1`` and ``state.z``
    (``optax.contrib.schedule_free_eval_params(state, params)``) reach the
    one NamedTuple of ``inner_state`` that has that field. Setting
    ``state.hyperparams["learning_rate"] = lr`` changes the inner's dict.
    Only called for names that are not this state's own.
    """
    if name.startswith("_"):
      raise AttributeError(name)
    ours = _OTHER_NAMES.get(name)
    try:
      return inner_field(self.inner_state, name)
    except AttributeError as e:
      if ours is not None:
        e.add_note(
            f"optax_accum: other trainers' {name!r} is oa.AccumulateState's"
            f" {ours!r} here (state.{ours}); its fields are"
            f" {', '.join(_Fields._fields)}.")
      raise


def remember_updates(state: AccumulateState, updates: Any) -> None:
  """Keeps weak references to the update leaves returned with ``state``."""
  try:
    refs = tuple(weakref.ref(u) for u in jax.tree.leaves(updates))
  except TypeError:  # a leaf that takes no weak reference (a Python float).
    return
  state.__dict__["returned"] = refs


def returned_with(state: AccumulateState, tree: Any) -> bool:
  """Whether ``tree``'s leaves are the updates returned with ``state``."""
  refs = state.__dict__.get("returned")
  leaves = jax.tree.leaves(tree)
  return bool(refs) and len(refs) == len(leaves) and all(
      r() is x for r, x in zip(refs, leaves))


def _states_with_field(tree, name, path=""):
  """The (path, node) of each NamedTuple in ``tree`` with field ``name``."""
  found = []
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    if name in tree._fields:
      found.append((path, tree))
    children = [(f".{f}", getattr(tree, f)) for f in tree._fields]
  elif isinstance(tree, (tuple, list)):
    children = [(f"[{i}]", x) for i, x in enumerate(tree)]
  elif isinstance(tree, dict):
    children = [(f"[{k!r}]", x) for k, x in tree.items()]
  else:
    children = []
  for where, child in children:
    found += _states_with_field(child, name, path + where)
  return found


def inner_field(inner_state, name):
  """``name`` of the one state in ``inner_state`` that has it, or our error."""
  found = _states_with_field(inner_state, name)
  if len(found) == 1:
    return getattr(found[0][1], name)
  hint = (
      "optax.tree.get(state, key) and optax.tree.set(state, key=value) find"
      " a named leaf anywhere in it, and state.inner_state is the inner"
      f" optimizer's state ({type(inner_state).__name__})."
  )
  if found:
    raise AttributeError(
        f"'AccumulateState' has no attribute {name!r}, and the inner"
        f" optimizer's state has {len(found)} fields of that name (at"
        f" state.inner_state{', state.inner_state'.join(p for p, _ in found)}):"
        f" read the one you mean there. {hint}"
    )
  raise AttributeError(
      f"'AccumulateState' has no attribute {name!r}, nor has any state"
      f" inside the inner optimizer's state: oa.accumulate's state wraps the"
      f" inner's. {hint}"
  )


def check_state(updates, state, params) -> None:
  """``update``'s state must be ours: a clear error for swapped arguments."""
  if isinstance(state, AccumulateState):
    return
  usage = ("call tx.update(grads, state, params), with state the"
           " AccumulateState that tx.init(params) returned (or the last"
           " update's)")
  if isinstance(updates, AccumulateState):
    raise TypeError(
        "tx.update got the AccumulateState as its first argument (the"
        f" gradients) and a {type(state).__name__} as its state:"
        f" the arguments are swapped; {usage}.")
  if isinstance(params, AccumulateState):
    raise TypeError(
        "tx.update got the AccumulateState as its third argument (params)"
        f" and a {type(state).__name__} as its state: the arguments are"
        f" swapped; {usage}.")
  raise TypeError(
      f"tx.update's state must be an AccumulateState, got"
      f" {type(state).__name__}: {usage}. An optax.chain or another wrapper"
      " around oa.accumulate passes it its own part of the chain's state.")


# The fields of AccumulateState that hold per-device scalars under axis_name.
PER_DEVICE_COUNTS = (
    "token_count", "nonfinite_count", "skipped_count", "stats_sums",
    "value_sums",
)


def _zero_where(flag, tree):
  return jax.tree.map(lambda x: jnp.where(flag, jnp.zeros_like(x), x), tree)


def _compensated_add(total, error, x):
  """``total + x`` in float32, the rounding error kept (Kahan summation)."""
  y = x - error
  new_total = total + y
  return new_total, (new_total - total) - y


def next_state(state, micro_step, emit, step: sum_layout.MicroStep,
               emitted: Any, grad_sum: Any):
  """The state after a call; ``emitted`` is what the emit decision handed
  back (``emit.Emitted``), ``grad_sum`` the sum's buffer to keep."""
  cycle = step.cycle
  tokens_seen, tokens_seen_error = _compensated_add(
      state.tokens_seen, state.tokens_seen_error, emitted.tokens)
  return AccumulateState(
      micro_step=_zero_where(emit, micro_step),
      count=microstep.increment_where(emitted.updated, state.count),
      grad_sum=grad_sum,  # reset lazily: see microstep.add_to_sum.
      token_count=_zero_where(emit, cycle.token_count),
      inner_state=emitted.inner_state,
      emitted=emitted.updated,
      nonfinite_count=step.nonfinite_count,
      skipped_count=step.skipped_count,
      stats_sums=_zero_where(emit, cycle.stats_sums),
      stats=emitted.stats,
      tokens_seen=tokens_seen,
      tokens_seen_error=tokens_seen_error,
      value_sums=_zero_where(emit, cycle.value_sums),
  )


def first_state(start: sum_layout.Start) -> AccumulateState:
  """The state before the first micro-step, around a form's ``start``."""
  cycle = start.cycle
  return AccumulateState(
      micro_step=jnp.zeros([], jnp.int32),
      count=jnp.zeros([], jnp.int32),
      grad_sum=cycle.grad_sum,
      token_count=cycle.token_count,
      inner_state=start.inner_state,
      emitted=jnp.zeros([], jnp.bool_),
      nonfinite_count=start.nonfinite_count,
      skipped_count=start.skipped_count,
      stats_sums=cycle.stats_sums,
      stats=None if cycle.stats_sums is None else noise_scale.nan_stats(),
      tokens_seen=jnp.zeros([], jnp.float32),
      tokens_seen_error=jnp.zeros([], jnp.float32),
      value_sums=cycle.value_sums,
  )
