"""Applying :func:`optax_accum.accumulate`'s updates: only where it emitted.

A non-emitting micro-step returns all-zero updates, which
``optax.apply_updates`` would add anyway: one pass over the parameters per
micro-step for nothing. :func:`apply_if_updated` puts the add in the
emitting branch of a ``lax.cond``; :func:`update_and_apply` runs the whole
micro-step with the parameters in the emitting branch's carry
(:meth:`transform.AccumulateTransformation.update_and_apply`), so that no
updates leave it: the one copy-free form.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import conditional_loops
from optax_accum._src import tree_match
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import state_access
from optax_accum._src.accumulate import transform


def _keep(params, updates):
  del updates
  return params


def _select_add(emitted, applied, params):
  """``applied`` where ``emitted``, else ``params`` bit for bit: one pass,
  elementwise, the select fused into the add."""
  return jax.tree.map(lambda a, p: None if p is None else jnp.where(
      emitted, a, p), applied, params, is_leaf=lambda x: x is None)


def _check_like_params(params: Any, updates: Any) -> None:
  """Refuses updates that are not shaped like the parameters."""
  is_none = lambda x: x is None
  params_def = jax.tree.structure(params, is_leaf=is_none)
  updates_def = jax.tree.structure(updates, is_leaf=is_none)
  if params_def != updates_def:
    raise ValueError(
        "updates must have the tree structure of params (the updates that"
        " tx.update returned for them): "
        + tree_match.first_difference(updates, params, "params", is_none)
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


_USAGE = ("updates, new_state = tx.update(grads, state, params); params ="
          " oa.apply_if_updated(params, updates, new_state)")


def _check_pairing(params: Any, updates: Any,
                   found: state_lib.AccumulateState) -> None:
  """Refuses parameters and updates passed swapped."""
  if (state_lib.returned_with(found, params)
      and not state_lib.returned_with(found, updates)):
    raise ValueError(
        "oa.apply_if_updated(params, updates, state) got the updates that"
        " tx.update returned as its first argument, params: the parameters"
        " and the updates are swapped. Write " + _USAGE + ".")


def apply_if_updated(
    params: optax.Params, updates: optax.Updates, state: Any
) -> optax.Params:
  """``optax.apply_updates`` on a call that emitted; ``params`` otherwise.

  The choice is a :func:`jax.lax.cond` on :func:`optax_accum.has_updated`
  (on GPUs a loop of at most one trip, whose carry XLA keeps in place):
  on a non-emitting micro-step (whose updates are all zeros) the parameters
  are not read, added to or written; with the parameters donated to the
  jitted train step, XLA passes their buffers through in place. On the CPU
  it is a select fused into the add instead (one pass over the parameters,
  in place): there a conditional's operand is allocated afresh on every
  call. The result is that of ``optax.apply_updates(params, updates)``
  whenever the call emitted (each leaf in its parameter's dtype), and
  ``params`` itself, bit for bit, otherwise.

  The updates are an operand of that conditional, so the micro-step holds
  a buffer of them (one parameter-sized buffer above ``optax.MultiSteps``'s
  peak on TPU and GPU): :func:`optax_accum.update_and_apply` is the
  copy-free form (``docs/performance.md``).

  Pass the updates and the state that one ``tx.update`` call returned: the
  state passed *into* that call says whether the call *before* emitted, and
  the parameters would then never move (:func:`optax_accum.check_k_invariance`
  reports that; :func:`optax_accum.update_and_apply` needs no pairing).
  Parameters and updates passed swapped are refused where this can tell
  (see :class:`optax_accum.AccumulateState`).

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
  found = state_access.accumulate_states(state, "state")[0]
  _check_pairing(params, updates, found)
  emitted = state_access.first_state(state, "state").emitted
  apply = jax.jit(optax.apply_updates)  # one trace for the three variants.
  # On GPUs a loop of at most one trip: XLA's GPU compiler copies the
  # parameters a conditional passes through; a loop's carry it keeps. On
  # the CPU a select fused into the add: a conditional's operand would be
  # allocated afresh on every call (page faults: 3.5x the floor's time).
  return conditional_loops.per_compiler(
      lambda: lax.cond(emitted, apply, _keep, params, updates),
      lambda: conditional_loops.run_if(emitted, apply, params, updates),
      cpu=lambda: _select_add(emitted, apply(params, updates), params))


_SIGNATURE = ("oa.update_and_apply(tx, grads, state, params, *,"
              " num_tokens=None, emit=None, **extra_args)")
_MISSING = object()


def _is_transformation(x: Any) -> bool:
  return isinstance(x, optax.GradientTransformation)


def _check_call(tx, grads, state, params) -> None:
  """Our error for a missing argument or arguments in another order."""
  given = {"tx": tx, "grads": grads, "state": state, "params": params}
  missing = [name for name, x in given.items() if x is _MISSING]
  if missing:
    raise TypeError(f"{_SIGNATURE}: missing {', '.join(missing)}.")
  if not _is_transformation(tx):
    where = [name for name, x in given.items() if _is_transformation(x)]
    hint = (f" (the transformation came as {where[0]}: the arguments are in"
            " another order)" if where else "")
    raise TypeError(
        f"{_SIGNATURE}: tx must be the optax transformation (what"
        f" oa.accumulate returned), got {type(tx).__name__}{hint}.")
  if params is None:
    raise ValueError(f"{_SIGNATURE} needs the parameters: params=None.")
  holds_state = lambda x: any(
      isinstance(n, state_lib.AccumulateState) for n in jax.tree.leaves(
          x, is_leaf=lambda n: isinstance(n, state_lib.AccumulateState)))
  for name, x in (("grads", grads), ("params", params)):
    if holds_state(x) and not holds_state(state):
      raise TypeError(
          f"{_SIGNATURE}: the optimizer state came as {name}: the"
          " arguments are in another order.")
  if not holds_state(state) and not isinstance(
      tx, transform.AccumulateTransformation):
    raise TypeError(
        f"{_SIGNATURE}: tx is not oa.accumulate or a chain holding it (its"
        f" state, a {type(state).__name__}, holds no AccumulateState), so"
        " there is no cycle to apply the update in. Wrap the optimizer:"
        " tx = oa.accumulate(optimizer, every_k=k), and state = tx.init("
        "params); a plain optax optimizer's updates go through"
        " optax.apply_updates.")


def update_and_apply(
    tx: optax.GradientTransformation = _MISSING,
    grads: optax.Updates = _MISSING,
    state: Any = _MISSING,
    params: optax.Params = _MISSING,
    **kwargs: Any,
) -> tuple[optax.Params, Any]:
  """One micro-step of ``tx``, its update applied to ``params`` in place.

  For the transformation :func:`optax_accum.accumulate` returns (an
  :class:`optax_accum.AccumulateTransformation`: this calls its
  ``update_and_apply``), the updates are applied inside its emitting branch
  and ``params`` pass through the other one, so that no updates leave the
  conditional: with the parameters donated to the jitted train step, XLA
  needs no parameter-sized buffer of updates. This is the one copy-free
  per-call form (``docs/performance.md``). The choice to emit is a loop of
  at most one trip on GPUs (XLA's GPU compiler copies the parameters a
  conditional passes through; a loop's carry it updates in place):
  :func:`optax_accum.count_collectives` counts what runs in it as in a
  branch. Differentiated (meta-learning through an update), it is the
  conditional. A non-emitting call runs no inner update.

  Any other ``tx`` (an ``optax.chain`` around ``accumulate``) is run as
  ``tx.update`` then :func:`optax_accum.apply_if_updated`: the same result,
  with the updates in a buffer of their own.

  The parameters are those of ``tx.update`` + ``optax.apply_updates`` but
  for the last bits: there the updates are rounded to their dtype before
  the add, here XLA fuses the inner's last arithmetic into the add (as it
  does in one jitted ``inner.update`` + ``optax.apply_updates``, which
  adamw's matches bit for bit). Measured on the CPU after 10 adamw or Muon
  updates: at most 3 float32 ulp (1.2e-7 on parameters of order 1).

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
  _check_call(tx, grads, state, params)
  if isinstance(tx, transform.AccumulateTransformation):
    return tx.update_and_apply(grads, state, params, **kwargs)
  updates, state = tx.update(grads, state, params, **kwargs)
  return apply_if_updated(params, updates, state), state
