"""Reading :func:`optax_accum.accumulate`'s state, and acting on it.

Finding the accumulation state inside a larger optimizer state (a chain, an
``nnx.Optimizer``, a ``TrainState``) and reading what it says
(:func:`has_updated`, :func:`grad_stats`, :func:`tokens_seen`). Applying its
updates is :mod:`applying`'s.
"""

from typing import Any

import jax

from optax_accum._src import flax_nnx
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.rules import noise_scale


def _is_state(node: Any) -> bool:
  return isinstance(node, state_lib.AccumulateState)


def accumulate_states(
    tree: Any, name: str = "tree"
) -> list[state_lib.AccumulateState]:
  """Every :class:`AccumulateState` inside ``tree``, in depth-first order.

  ``name`` is the caller's argument, for the error.

  Raises:
    ValueError: if there is none.
  """
  if _is_state(tree):
    return [tree]
  found = [
      node for node in jax.tree.leaves(tree, is_leaf=_is_state)
      if _is_state(node)
  ]
  if not found:
    raise ValueError(
        f"{name} must contain an AccumulateState (the state of"
        " optax_accum.accumulate or of a chain holding it), got a"
        f" {type(tree).__name__} with none. Pass the state that tx.update"
        " returned."
    )
  return found


def first_state(tree: Any, name: str) -> state_lib.AccumulateState:
  """The first :class:`AccumulateState` in ``tree`` (argument ``name``)."""
  return flax_nnx.unwrap_variables(accumulate_states(tree, name)[0])


def find_accumulate_state(tree: Any) -> state_lib.AccumulateState:
  """Returns the first :class:`AccumulateState` inside an optimizer state.

  The state of :func:`optax_accum.accumulate` is often nested: inside an
  ``optax.chain``, an ``optax.inject_hyperparams`` or a training framework's
  optimizer wrapper. This finds it in any pytree, including the ``opt_state``
  of a Flax ``nnx.Optimizer`` (or the optimizer itself), whose leaves are NNX
  variables: those are unwrapped, so the fields are plain arrays.

  Args:
    tree: an optimizer state, or any pytree containing one.

  Returns:
    The first :class:`AccumulateState` found in depth-first order.

  Raises:
    ValueError: if ``tree`` contains none.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = optax.chain(optax.scale(0.5), oa.accumulate(optax.sgd(0.1), 4))
    >>> state = tx.init({'w': jnp.zeros(3)})
    >>> oa.find_accumulate_state(state).micro_step
    Array(0, dtype=int32)
  """
  return first_state(tree, "tree")


def has_updated(state: Any) -> jax.Array:
  """Whether the ``update`` call that produced ``state`` emitted an update.

  Args:
    state: an :class:`AccumulateState`, or an optimizer state containing one.

  Returns:
    A boolean scalar: true iff that call completed a cycle with tokens and
    ran the inner optimizer.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=2, equal_weights=True)
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.ones(3)}, state, params)
    >>> oa.has_updated(state)
    Array(False, dtype=bool)
  """
  return first_state(state, "state").emitted


def grad_stats(state: Any) -> noise_scale.GradStats:
  """The gradient noise statistics of the last cycle that emitted.

  Args:
    state: the state of :func:`optax_accum.accumulate` built with
      ``with_stats=True``, or an optimizer state containing one.

  Returns:
    An :class:`optax_accum.GradStats`; NaN before the first emitting call.

  Raises:
    ValueError: if the state was built without ``with_stats=True``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=2, with_stats=True)
    >>> params = {'w': jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g, n in (([3.0, 1.0], 2), ([1.0, -1.0], 2)):
    ...   _, state = tx.update({'w': jnp.array(g)}, state, params, num_tokens=n)
    >>> stats = oa.grad_stats(state)
    >>> # mean [2, 0]: tr = (2*|g1|^2 + 2*|g2|^2 - 4*|mean|^2) / (2 - 1)
    >>> stats.trace_cov, stats.grad_sq_norm  # (20 + 4 - 16) / 1, 4 - 8/4
    (Array(8., dtype=float32), Array(2., dtype=float32))
  """
  found = first_state(state, "state")
  if found.stats is None:
    raise ValueError(
        "state holds no gradient statistics: build the transformation with"
        " optax_accum.accumulate(..., with_stats=True)."
    )
  return found.stats


def tokens_seen(state: Any) -> jax.Array:
  """The tokens behind every update emitted since ``init``.

  The sum, over the updates :func:`optax_accum.accumulate` has emitted, of
  the token counts their means divided by: the ``num_tokens`` of the kept
  micro-steps, over every device with ``axis_name``. Micro-steps dropped by
  ``skip_nonfinite`` or ``should_skip`` do not count, nor do those of the
  current, unfinished cycle; with ``equal_weights=True`` (no
  ``num_tokens``) each kept micro-step counts 1. It is part of the state, so
  it is saved and restored with it: a schedule or a log stated in tokens
  resumes where it stopped.

  Args:
    state: an :class:`AccumulateState`, or an optimizer state containing one.

  Returns:
    A float32 scalar, the same on every device. It is a compensated
    (Kahan) sum: exact for integer counts up to about ``2**24`` tokens,
    and within a float32 rounding of the total beyond.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(0.1), every_k=2)
    >>> params = {'w': jnp.zeros(3)}
    >>> state = tx.init(params)
    >>> for n in (3, 4, 5):  # one update of 3 + 4 tokens, then a micro-step
    ...   _, state = tx.update({'w': jnp.ones(3)}, state, params, num_tokens=n)
    >>> oa.tokens_seen(state)
    Array(7., dtype=float32)
  """
  return first_state(state, "state").tokens_seen
