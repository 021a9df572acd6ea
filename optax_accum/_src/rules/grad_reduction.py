r"""How each gradient leaf is reduced over micro-batches: the one rule.

Both entry points (``oa.accumulate`` and ``oa.value_and_grad``) take
``grad_reduction``, a pytree prefix of the gradient whose leaves are:

* ``"mean"`` (the default): the token-weighted mean of :mod:`token_weighting`;
* ``"max"``: the maximum over the kept micro-batches, and with ``axis_name``
  over the devices too (a ``pmax``, once per update). FP8 training keeps its
  amax histories and scales as parameters whose "gradients" are new values
  to keep, not to average (``flax.linen.fp8_ops``, Keras'
  ``overwrite_with_gradient``);
* ``"last"``: the last kept micro-batch's value (refused with ``axis_name``:
  devices have no order).

A kept micro-batch has tokens and was not dropped (``skip_nonfinite``,
``should_skip``): :attr:`token_weighting.Contribution.keep`. A "max" or
"last" leaf takes the raw gradient, neither weighted by the token count nor
divided by it, whatever ``loss_reduction``. Without any kept micro-batch the
result is zeros, as for a "mean" leaf of a cycle without tokens. A running
"max" starts at ``-inf``, the identity of the maximum, so that a device
without kept micro-batches does not count in the ``pmax``.
"""

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import tree_match
from optax_accum._src.mesh import manual
from optax_accum._src.rules import token_weighting

MEAN, MAX, LAST = "mean", "max", "last"
REDUCTIONS = (MEAN, MAX, LAST)


def check_grad_reduction(grad_reduction: Any, axis_name: Any) -> Any:
  """``grad_reduction`` if every leaf is a known rule (construction time).

  Returns None for a single "mean": the plain sum, unchanged. A tree, even
  of "mean" only, is kept, so that :func:`rules_per_leaf` checks that it fits
  the
  gradient (a misspelt key would otherwise go unnoticed).
  """
  leaves = jax.tree_util.tree_flatten_with_path(grad_reduction)[0]
  if not leaves:
    raise ValueError(
        f"grad_reduction must be one of {REDUCTIONS} or a pytree prefix of"
        f" the gradient with those as leaves, got {grad_reduction!r}."
    )
  for path, leaf in leaves:
    if not isinstance(leaf, str) or leaf not in REDUCTIONS:
      raise ValueError(
          f"grad_reduction{jax.tree_util.keystr(path)} must be one of"
          f" {REDUCTIONS}, got {leaf!r}."
      )
    if leaf == LAST and axis_name is not None:
      raise ValueError(
          f"grad_reduction{jax.tree_util.keystr(path)}='last' cannot be used"
          f" with axis_name={axis_name!r}: the devices' micro-batches have no"
          " order. Use 'max', or reduce without axis_name."
      )
  if isinstance(grad_reduction, str) and grad_reduction == MEAN:
    return None
  return grad_reduction


def rules_per_leaf(grad_reduction: Any, tree: Any) -> list[str] | None:
  """The rule of each leaf of ``tree``, in order; None if all are "mean"."""
  if grad_reduction is None:
    return None
  rules = tree_match.prefix_leaves("grad_reduction", grad_reduction, tree,
                                   "the gradient")
  return None if all(rule == MEAN for rule in rules) else rules


def _identity(rule: str, dtype: Any) -> jax.Array:
  if rule == MAX:
    return jnp.full([], -jnp.inf, dtype)
  return jnp.zeros([], dtype)


def _map(fn, rules, tree, *rest):
  """``fn(rule, leaf, *rest_leaves)`` over ``tree``'s leaves."""
  leaves, treedef = jax.tree.flatten(tree)
  rest = [treedef.flatten_up_to(r) for r in rest]
  return jax.tree.unflatten(treedef, [
      fn(rule, *args) for rule, *args in zip(rules, leaves, *rest)])


def restart(total: Any, rules: list[str] | None, start: jax.Array) -> Any:
  """Each running value, or its rule's identity where ``start`` is true."""
  if rules is None:
    return jax.tree.map(
        lambda s: jnp.where(start, jnp.zeros([], s.dtype), s), total)
  return _map(lambda r, s: jnp.where(start, _identity(r, s.dtype), s),
              rules, total)


def start(total: Any, rules: list[str] | None) -> Any:
  """``total`` (zeros) with the "max" leaves at ``-inf``.

  The other leaves are returned as they are (they may be typed unreduced,
  on which JAX has no ``where``).
  """
  if rules is None:
    return total
  return _map(lambda r, s: jnp.where(True, _identity(r, s.dtype), s)
              if r == MAX else s, rules, total)


def add_by_rule(total: Any, grads: Any, c: token_weighting.Contribution,
        rules: list[str] | None) -> Any:
  """Adds one micro-batch to the running values, each leaf by its rule."""
  if rules is None:
    return token_weighting.add_weighted(total, grads, c)

  def add_leaf(rule, s, g):
    if rule == MEAN:
      return s + token_weighting.weighted(g, c, s.dtype).reshape(s.shape)
    g = jnp.asarray(g).astype(s.dtype).reshape(s.shape)
    new = jnp.maximum(s, g) if rule == MAX else g
    return jnp.where(c.keep, new, s)

  return _map(add_leaf, rules, total, grads)


def divide_means(total: Any, token_count: jax.Array,
                 rules: list[str] | None) -> Any:
  """``total`` with its "mean" leaves divided by the token count (zeros
  without tokens where the sums are zero: :func:`mean_by_rule` zeroes the
  rest after the reduction), each in its own dtype; "max" and "last"
  leaves as is."""
  means = token_weighting.mean(total, token_count, total)
  if rules is None:
    return means
  return _map(lambda r, m, s: m if r == MEAN else s, rules, means, total)


def mean_by_rule(total: Any, token_count: jax.Array, like: Any,
                 rules: list[str] | None, divided: bool = False, *,
                 zeros_if_empty: bool = False) -> Any:
  """The reduced gradient, cast leaf by leaf like ``like``.

  "mean" leaves are divided by the token count (or, ``divided``, were
  already: :func:`divide_means`); "max" and "last" leaves are as they are,
  or zeros without tokens; ``zeros_if_empty`` as for
  :func:`token_weighting.mean`.
  """
  means = token_weighting.mean(  # divided: cast only (x / 1 is x).
      total, jnp.ones_like(token_count) if divided else token_count, like,
      zeros_if_empty=zeros_if_empty and not divided)
  if divided and zeros_if_empty:
    # After the reduction: the same select before it, in divide_means, held
    # 15 MiB more temp on TPU v5e (benchmark q's decoder, data parallel).
    means = token_weighting.zeros_without_tokens(means, token_count)
  if rules is None:
    return means

  def finish_leaf(rule, mean, s):
    if rule == MEAN:
      return mean
    return token_weighting.zeros_without_tokens(s, token_count).astype(
        mean.dtype)

  return _map(finish_leaf, rules, means, total)


def only_means(tree: Any, rules: list[str] | None) -> Any:
  """``tree`` with its "max" and "last" leaves zeroed: the noise scale's."""
  if rules is None:
    return tree
  return _map(lambda r, x: x if r == MEAN else jnp.zeros_like(x), rules, tree)


def max_over_devices(total: Any, rules: list[str] | None, axis_name: Any,
                     keep_on_one_device: bool = False) -> Any:
  """The "max" leaves' maximum over ``axis_name`` (a pmax); others as is.

  With ``keep_on_one_device``, the maximum stays on the axis' first device
  and the others hold zeros, so that a sum over the axis that follows (the
  one reduction of the loop's sums) gives the maximum back exactly.
  """
  if rules is None or MAX not in rules:
    return total
  leaves, treedef = jax.tree.flatten(total)
  maxima = lax.pmax([s for s, r in zip(leaves, rules) if r == MAX], axis_name)
  out = []
  for s, rule in zip(leaves, rules):
    if rule == MAX:
      s = maxima.pop(0)
      if keep_on_one_device:
        s = manual.on_first_device(s, axis_name)
    out.append(s)
  return jax.tree.unflatten(treedef, out)
