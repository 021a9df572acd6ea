"""An ``nnx.Optimizer`` that applies :func:`optax_accum.accumulate`'s update
only when it emits, as Flax extends its own optimizer.

Imported on first use of ``oa.AccumulatingOptimizer`` (optax_accum does not
need flax otherwise).
"""

from typing import Any

from flax import nnx

from optax_accum._src.accumulate import applying
from optax_accum._src.accumulate import state_access

# nnx.as_pure since flax 0.12.5; nnx.pure before.
_as_pure = getattr(nnx, "as_pure", None) or nnx.pure


def _is_transformation(tx: Any) -> bool:
  """An optax transformation: ``init`` and ``update``, and not a Module."""
  return (not isinstance(tx, nnx.Module)
          and callable(getattr(tx, "init", None))
          and callable(getattr(tx, "update", None)))


def _kind(x: Any) -> str:
  """``x``'s type in an error message (None as itself)."""
  return "None" if x is None else type(x).__name__


def _check_init_args(model: Any, tx: Any) -> None:
  """Raises naming the argument before flax reads ``tx.init``."""
  if isinstance(tx, nnx.Module) and _is_transformation(model):
    raise TypeError(
        f"oa.AccumulatingOptimizer got tx={type(tx).__name__} (an"
        f" nnx.Module) and model={type(model).__name__} (an optax"
        " transformation): the arguments are swapped. Call"
        " oa.AccumulatingOptimizer(model, tx, wrt=...), the model first.")
  if not _is_transformation(tx):
    raise TypeError(
        "tx must be an optax GradientTransformation holding oa.accumulate"
        " (such as oa.accumulate(optax.adamw(1e-3), every_k=4)), got"
        f" {_kind(tx)}: oa.AccumulatingOptimizer(model, tx, wrt=...).")
  if model is None or _is_transformation(model):
    raise TypeError(
        f"model must be the nnx.Module to train, got {_kind(model)}:"
        " oa.AccumulatingOptimizer(model, tx, wrt=...).")


def _check_update_args(model: Any, grads: Any) -> None:
  """Raises on ``update(grads, model)``, which would use the model's
  weights as the gradients (and write the update into ``grads``)."""
  if isinstance(grads, nnx.Module) and not isinstance(model, nnx.Module):
    raise TypeError(
        "AccumulatingOptimizer.update(model, grads) got"
        f" model={type(model).__name__} (expected the nnx.Module to update)"
        f" and grads={type(grads).__name__} (an nnx.Module where the"
        " gradients, an nnx.State as nnx.grad returns, were expected): the"
        " arguments are swapped. Call optimizer.update(model, grads, ...).")


class AccumulatingOptimizer(nnx.Optimizer):
  """``nnx.Optimizer`` for a transformation holding :func:`accumulate`.

  Built as ``nnx.Optimizer`` is, with ``tx`` an :func:`accumulate` (or an
  ``optax.chain`` holding one). Its :meth:`update` takes one micro-batch's
  gradient per call and runs :func:`optax_accum.update_and_apply`: the
  model's parameters change only on the call that emits (in the emitting
  branch, with no pass over them on the other calls), and ``step`` counts
  the updates applied, as the full batch's ``nnx.Optimizer`` counts its
  own. ``nnx.Optimizer.update`` would instead add the (zero) updates on
  every call and count micro-steps.

  Examples:
    >>> from flax import nnx
    >>> import jax.numpy as jnp, optax
    >>> import optax_accum as oa
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = oa.AccumulatingOptimizer(
    ...     model, oa.accumulate(optax.sgd(0.1), every_k=2), wrt=nnx.Param)
    >>> loss_fn = lambda model, x: (model(x) ** 2).mean()
    >>> before = model.kernel[...]
    >>> for x in (jnp.ones((1, 2)), jnp.ones((3, 2))):  # 1 row, then 3.
    ...   grads = nnx.grad(loss_fn)(model, x)
    ...   optimizer.update(model, grads, num_tokens=x.shape[0])
    ...   moved = bool((model.kernel[...] != before).any())
    ...   print(int(optimizer.step[...]), moved)
    0 False
    1 True
  """

  def __init__(self, model: Any, tx: Any, *, wrt: Any, **kwargs: Any):
    _check_init_args(model, tx)
    super().__init__(model, tx, wrt=wrt, **kwargs)
    # Raises, naming the mistake, unless tx holds an accumulate.
    state_access.find_accumulate_state(self.opt_state)

  def _state(self, tree: Any) -> Any:
    graph = getattr(self, "graph", None)  # flax >= 0.12.7.
    if graph is None:
      return nnx.state(tree, self.wrt)
    return nnx.state(tree, self.wrt, graph=graph)

  def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
    """Adds one micro-batch's ``grads`` and, on the call that emits,
    applies the update to ``model``'s parameters (the ``wrt`` ones).

    ``kwargs`` reach ``tx.update``: ``num_tokens`` (the micro-batch's
    count), ``emit`` and the inner optimizer's extra arguments.
    """
    _check_update_args(model, grads)
    params, opt_state = applying.update_and_apply(
        self.tx, _as_pure(self._state(grads)), _as_pure(self.opt_state),
        _as_pure(self._state(model)), **_as_pure(kwargs))
    nnx.update(model, params)
    graph = getattr(self, "graph", None)
    nnx.update(self.opt_state, nnx.state(opt_state) if graph is None
               else nnx.state(opt_state, graph=graph))
    self.step[...] += state_access.has_updated(opt_state).astype(
        self.step[...].dtype)
