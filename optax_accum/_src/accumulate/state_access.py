"""Reading :func:`optax_accum.accumulate`'s state, and acting on it.

Finding the accumulation state inside a larger optimizer state (a chain, an
``nnx.Optimizer``, a ``TrainState``), reading what it says
(:func:`has_updated`, :func:`grad_stats`, :func:`tokens_seen`), and applying
its updates only when it emitted (:func:`apply_if_updated`): a non-emitting
micro-step returns all-zero updates, which ``optax.apply_updates`` would add
anyway, one pass over the parameters per micro-step for nothing;
:func:`apply_if_updated` puts the add in the emitting branch of a
``lax.cond``, so a non-emitting train step whose parameters are donated
passes its parameters through untouched.
"""

import sys
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import conditional_loops
from optax_accum._src import validation
from optax_accum._src.accumulate import emitting
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import update_slot
from optax_accum._src.rules import noise_scale


def _is_state(node: Any) -> bool:
  return isinstance(node, state_lib.AccumulateState)


def _variable_type() -> type | None:
  """Flax NNX's ``Variable`` class if flax is loaded, without importing it."""
  variablelib = sys.modules.get("flax.nnx.variablelib")
  return getattr(variablelib, "Variable", None)


def _unwrap_variables(state: state_lib.AccumulateState) -> Any:
  """Replaces NNX ``Variable`` leaves by the arrays they hold.

  ``nnx.Optimizer`` keeps its ``opt_state`` as a pytree whose array leaves are
  wrapped in ``OptState`` variables; users of this module expect arrays.
  """
  variable_type = _variable_type()
  if variable_type is None:
    return state
  is_variable = lambda x: isinstance(x, variable_type)
  return jax.tree.map(
      lambda x: x.get_value() if is_variable(x) else x,
      state,
      is_leaf=is_variable,
  )


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
  return _unwrap_variables(accumulate_states(tree, name)[0])


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


def _keep(params, updates):
  del updates
  return params


def _check_like_params(params: Any, updates: Any) -> None:
  """Refuses updates that are not shaped like the parameters."""
  is_none = lambda x: x is None
  params_def = jax.tree.structure(params, is_leaf=is_none)
  updates_def = jax.tree.structure(updates, is_leaf=is_none)
  if params_def != updates_def:
    raise ValueError(
        "updates must have the tree structure of params (the updates that"
        " tx.update returned for them): "
        + validation.first_difference(updates, params, "params", is_none)
        + "."
    )
  leaves = jax.tree.leaves(updates, is_leaf=is_none)
  with_paths = jax.tree_util.tree_leaves_with_path(params, is_leaf=is_none)
  for (path, p), u in zip(with_paths, leaves):
    if p is not None and u is not None and jnp.shape(p) != jnp.shape(u):
      where = jax.tree_util.keystr(path)
      raise ValueError(
          f"updates{where} has shape {jnp.shape(u)}, but params{where} has"
          f" shape {jnp.shape(p)}."
      )


def apply_if_updated(
    params: optax.Params, updates: optax.Updates, state: Any
) -> optax.Params:
  """``optax.apply_updates`` on a call that emitted; ``params`` otherwise.

  The choice is a :func:`jax.lax.cond` on :func:`optax_accum.has_updated`:
  on a non-emitting micro-step (whose updates are all zeros) the parameters
  are not read, added to or written; with the parameters donated to the
  jitted train step, XLA passes their buffers through in place. The result is
  that of ``optax.apply_updates(params, updates)`` whenever the call emitted
  (each leaf in its parameter's dtype), and ``params`` itself otherwise.

  Given the very updates and state of one :func:`optax_accum.accumulate`
  call without a data axis, it reads the updates from the running sum's
  buffer, where that call kept them, in its emitting branch alone (on GPUs a
  loop of at most one trip, whose carry XLA keeps in place): the micro-step
  then needs no parameter-sized buffer of updates (``docs/performance.md``).

  ``flax.nnx.Optimizer.update`` applies its updates itself, with
  ``optax.apply_updates``. To skip that pass, call the transformation
  yourself and write the parameters back with :func:`flax.nnx.update`::

    params = nnx.as_pure(nnx.state(model, nnx.Param))
    opt_state = nnx.as_pure(optimizer.opt_state)
    updates, opt_state = optimizer.tx.update(grads, opt_state, params,
                                             num_tokens=n)
    nnx.update(model, oa.apply_if_updated(params, updates, opt_state))
    nnx.update(optimizer.opt_state, nnx.state(opt_state))

  (``nnx.as_pure`` is ``nnx.pure`` in older flax; ``optimizer.step``,
  which ``nnx.Optimizer.update`` increments, is then
  yours to count.) Or use :func:`optax_accum.value_and_grad`, which calls
  ``optimizer.update`` once per update, with nothing to skip.

  Args:
    params: the parameters.
    updates: the updates of the ``update`` call that produced ``state``.
    state: the state that call returned: an
      :class:`optax_accum.AccumulateState`, or an optimizer state containing
      one (an ``optax.chain``'s, an ``nnx.Optimizer``'s ``opt_state``).

  Returns:
    The new parameters, shaped and typed like ``params``.

  Raises:
    ValueError: if ``state`` contains no :class:`AccumulateState`, or if
      ``updates`` is not shaped like ``params``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> @jax.jit
    ... def train_step(params, state, grads):
    ...   updates, state = tx.update(grads, state, params)
    ...   return oa.apply_if_updated(params, updates, state), state
    >>> params, state = train_step(params, state, {'w': jnp.array([1., 3.])})
    >>> params['w']  # no update yet: untouched
    Array([1., 1.], dtype=float32)
    >>> params, state = train_step(params, state, {'w': jnp.array([3., 1.])})
    >>> params['w']  # 1 - mean of the two gradients
    Array([-1., -1.], dtype=float32)
  """
  _check_like_params(params, updates)
  ours = first_state(state, "state")
  found = update_slot.find(updates, ours.grad_sum)
  if found is None:
    return lax.cond(ours.emitted, optax.apply_updates, _keep, params,
                    updates)
  # The updates are where(updated, slot, 0): the slot is read in the
  # emitting branch alone (a loop's carry on GPUs, see update_slot).
  def apply_slot(params, slot):
    return optax.apply_updates(params, jax.tree.map(
        lambda s, u: s.astype(u.dtype), slot, updates))

  return emitting.per_compiler(
      lambda: lax.cond(found.updated, apply_slot, _keep, params, found.slot),
      lambda: conditional_loops.run_if(found.updated, apply_slot, params,
                                       found.slot))


def update_and_apply(
    tx: optax.GradientTransformation, grads: optax.Updates, state: Any,
    params: optax.Params, **kwargs: Any,
) -> tuple[optax.Params, Any]:
  """One micro-step of ``tx``, its update applied to ``params`` in place.

  For :func:`optax_accum.accumulate`, the updates are applied inside its
  emitting branch and ``params`` pass through the other one, so that no
  updates leave the conditional: with the parameters donated to the jitted
  train step, XLA needs no parameter-sized buffer of updates (nor does
  ``tx.update`` with :func:`optax_accum.apply_if_updated` without a data
  axis, which keeps them in the running sum's buffer; with one, or under
  ZeRO, it needs one: ``docs/performance.md``). The choice to emit is a loop
  of at most one trip (XLA's GPU compiler copies the parameters a conditional
  passes through; a loop's carry it updates in place):
  :func:`optax_accum.count_collectives` counts what runs in it as in a
  branch. Differentiated (meta-learning through an update), it is the
  conditional, in both modes. The result is
  that of ``tx.update`` and :func:`optax_accum.apply_if_updated`, and a
  non-emitting call still runs no inner update. Any other ``tx`` (an
  ``optax.chain`` around ``accumulate``) takes that path: its updates leave
  the conditional.

  Args:
    tx: the transformation, best an :func:`optax_accum.accumulate`.
    grads: this micro-step's gradients.
    state: ``tx``'s state.
    params: the parameters (donate them to the jitted step).
    **kwargs: ``num_tokens``, ``emit`` and any extra argument of ``tx``.

  Returns:
    The new parameters and the new state.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import optax_accum as oa
    >>> tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda p, s, g: oa.update_and_apply(tx, g, s, p),
    ...                donate_argnums=(0, 1))
    >>> params, state = step(params, state, {'w': jnp.array([1., 3.])})
    >>> params, state = step(params, state, {'w': jnp.array([3., 1.])})
    >>> params['w']
    Array([-1., -1.], dtype=float32)
  """
  if params is None:
    raise ValueError("update_and_apply needs the parameters: params=None.")
  fused = getattr(tx.update, "update_and_apply", None)
  if fused is not None:
    return fused(grads, state, params, **kwargs)
  updates, state = tx.update(grads, state, params, **kwargs)
  return apply_if_updated(params, updates, state), state
