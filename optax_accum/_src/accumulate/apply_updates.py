"""Applying the updates of :func:`optax_accum.accumulate`, only when it emitted.

A non-emitting micro-step returns all-zero updates. ``optax.apply_updates``
adds them anyway: one pass over the parameters per micro-step for nothing.
:func:`apply_if_updated` puts the add in the emitting branch of a
``lax.cond``, so a non-emitting train step whose parameters are donated
passes its parameters through untouched.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import optax

from optax_accum._src import validation
from optax_accum._src.accumulate import state as state_lib


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

  The zero updates themselves are still written by ``tx.update`` (they are
  outputs of its conditional); in a train step that computes its gradients,
  XLA writes them into the gradients' dead buffer.

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
  updated = state_lib.has_updated(state)
  return lax.cond(updated, optax.apply_updates, _keep, params, updates)
