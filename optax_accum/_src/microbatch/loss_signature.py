"""How ``oa.value_and_grad`` calls ``loss_fn``, and shapes what it returns.

The user's ``loss_fn`` takes ``(params, microbatch, *args, **kwargs)`` (with
``has_state``, ``(params, model_state, microbatch, ...)``), plus ``rng=`` when
the caller gave a key, and returns a loss, ``(loss, aux)``, ``(loss,
model_state)`` or ``(loss, (model_state, aux))``. The loop sees one shape:
``f(params, model_state, microbatch, inputs, rng) -> (loss, (state, aux))``,
with None for the missing parts; the caller gets :func:`jax.value_and_grad`'s.
"""

import functools
import inspect
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# The keyword by which loss_fn gets its micro-batch's key.
RNG = "rng"


class Inputs(NamedTuple):
  """One call's inputs after ``params``, as the loop reads them."""

  model_state: Any  # threaded model state, or None.
  batch: Any  # split into micro-batches along batch_axes.
  args: tuple[Any, ...]  # passed whole to every micro-batch.
  kwargs: dict[str, Any]  # passed whole to every micro-batch.
  rng: Any  # a PRNG key or None: one key per micro-batch derived from it.
  num_real: Any = None  # int32 scalar: micro-batches to run; None: all.


# How fn passes its arguments on to loss_fn, for errors about their order.
SIGNATURE = (
    "fn(params, batch, *args) calls loss_fn(params, microbatch, *args):"
    " params first (the arrays differentiated), the batch second (the one"
    " argument split into micro-batches; third, after model_state, with"
    " has_state=True), anything else whole through *args or a closure"
)

# What an Equinox user does instead.
EQUINOX = (
    "For an Equinox model, split it with diff, static = eqx.partition(model,"
    " eqx.is_inexact_array), write loss_fn(diff, batch, static) (not"
    " Equinox's usual loss(diff, static, batch)) calling eqx.combine(diff,"
    " static), and call fn(diff, batch, static), or close over static."
)


def order_hint(equinox: bool = False) -> str:
  """Says which argument is the batch, for a batch that looks misplaced."""
  hint = "Is the batch loss_fn's second argument? " + SIGNATURE + "."
  return hint + " " + EQUINOX if equinox else hint


def is_array(x: Any) -> bool:
  """An array, a tracer, a ``jax.ShapeDtypeStruct`` or a Python number."""
  return (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(
      x, numbers.Number)


def shown(x: Any) -> str:
  """``x`` in an error message: an array's type and shape, or a short repr."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{type(x).__name__} of shape {tuple(jnp.shape(x))}"
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + "..."


def check_params(params: Any) -> None:
  """Raises naming the leaf if ``params`` holds anything but arrays.

  JAX would say "not a valid JAX type" from inside the loop; the usual
  cause is a whole Equinox module (its activation functions are leaves).
  """
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not is_array(leaf):
      raise TypeError(
          f"params{jax.tree_util.keystr(path)} is a {type(leaf).__name__}"
          f" ({shown(leaf)}), not an array: every leaf of params, fn's"
          " first argument, is differentiated. " + EQUINOX + " " +
          SIGNATURE + ".")
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
          f"params{jax.tree_util.keystr(path)} has dtype"
          f" {jnp.result_type(leaf)}: every leaf of params, fn's first"
          " argument, is differentiated, and an integer or boolean has no"
          " gradient. Pass it outside params (in the batch, as an extra"
          " argument, or as model state with has_state=True).")


def _leading_sizes(tree: Any) -> set[int]:
  return {jnp.shape(x)[0] for x in jax.tree.leaves(tree)
          if is_array(x) and jnp.ndim(x)}


def _unsplit_args_hint(microbatch: Any, inputs: Inputs) -> str | None:
  """A note for a failing ``loss_fn``: arguments after the batch with the
  batch's leading size, which are passed whole, not split."""
  batch_sizes = _leading_sizes(inputs.batch) - _leading_sizes(microbatch)
  named = [(f"*args[{i}]", arg) for i, arg in enumerate(inputs.args)]
  named += [(f"{k}=", v) for k, v in inputs.kwargs.items() if k != RNG]
  suspects = [
      f"{name} (leading size {jnp.shape(leaf)[0]})"
      for name, arg in named
      for leaf in jax.tree.leaves(arg)[:1]
      if is_array(leaf) and jnp.ndim(leaf)
      and jnp.shape(leaf)[0] in batch_sizes
  ]
  if not suspects:
    return None
  rows = ", ".join(str(n) for n in sorted(_leading_sizes(microbatch)))
  return (
      "optax_accum: only the batch, fn's argument after params, is split"
      f" into micro-batches (of {rows} rows here): fn's"
      f" {', '.join(suspects)}, with the batch's leading size, reach"
      " loss_fn whole. Put every per-example array"
      " in the batch: fn(params, (x, y)) with loss_fn(params, batch) doing"
      " x, y = batch. " + SIGNATURE + ".")


def _one_row_axis(shape: tuple, micro_shape: tuple) -> int | None:
  """The split axis of a leaf (2-D or more) split into one-row slices."""
  differ = [i for i, (s, m) in enumerate(zip(shape, micro_shape)) if s != m]
  if (len(shape) < 2 or len(shape) != len(micro_shape) or len(differ) != 1
      or micro_shape[differ[0]] != 1):
    return None
  return differ[0]


def _stacked_batch_hint(microbatch: Any, inputs: Inputs) -> str | None:
  """A note for a failing ``loss_fn`` whose micro-batches hold one row each:
  a batch already stacked as ``(k, micro, ...)``, split again."""
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(inputs.batch)
  micro_leaves = jax.tree.leaves(microbatch)
  if len(paths_and_leaves) != len(micro_leaves):
    return None
  split = [(path, jnp.shape(leaf), jnp.shape(micro))
           for (path, leaf), micro in zip(paths_and_leaves, micro_leaves)
           if is_array(leaf) and jnp.shape(leaf) != jnp.shape(micro)]
  axes = [_one_row_axis(shape, micro_shape) for _, shape, micro_shape in split]
  if not split or None in axes:
    return None
  (path, shape, micro_shape), axis = split[0], axes[0]
  return (
      f"optax_accum: each of the num_microbatches={shape[axis]} micro-batches"
      f" holds one row of the batch: batch{jax.tree_util.keystr(path)} has"
      f" shape {shape}, its micro-batches {micro_shape}. fn splits the batch"
      " into micro-batches itself, along batch_axes (here axis"
      f" {axis}); a batch already stacked as (k, micro, ...) is split again."
      " Pass it unstacked, as (k * micro, ...)" + (
          ": jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)."
          if axis == 0 else "."))


def _describe(x: Any) -> str:
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"a single array of dtype {x.dtype} and shape {tuple(x.shape)}"
  return type(x).__name__


def scalar(loss: Any) -> jax.Array:
  """``loss`` as an array, or a clear error if it is not a real floating
  scalar (a Python float, as :func:`jax.value_and_grad` takes, becomes a
  weakly typed array: the loop reads its dtype)."""
  if not (hasattr(loss, "shape") or isinstance(loss, numbers.Number)):
    raise TypeError(
        "loss_fn must return a scalar loss (a mean or sum over its"
        f" micro-batch), got {_describe(loss)}."
    )
  if jnp.ndim(loss) != 0:
    raise ValueError(
        "loss_fn must return a scalar loss (a mean or sum over its"
        f" micro-batch), got shape {jnp.shape(loss)}."
    )
  if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
    raise TypeError(
        "loss_fn must return a real floating-point loss, got dtype"
        f" {jnp.result_type(loss)}: it is differentiated (an integer or"
        " boolean loss, such as a count of correct answers, has no"
        " gradient).")
  return jnp.asarray(loss)


def _unpaired(out: Any) -> Any:
  """The loss of a ``loss_fn`` without aux or state, checked."""
  if isinstance(out, (tuple, list)):
    raise TypeError(
        f"loss_fn returned a {type(out).__name__} of {len(out)} but"
        " has_aux=False, so a scalar loss was expected. Pass has_aux=True to"
        " oa.value_and_grad if loss_fn returns (loss, aux) (or"
        " has_state=True if it returns (loss, new_model_state))."
    )
  return scalar(out)


def normalize(loss_fn, has_aux, has_state):
  """``loss_fn`` in the loop's one shape.

  That is ``f(params, model_state, microbatch, inputs, rng) -> (loss,
  (model_state, aux))``, missing parts as None.
  """
  signature = _signature(loss_fn)

  @functools.wraps(loss_fn)
  def normalized(params, model_state, microbatch, inputs, rng):
    kwargs = inputs.kwargs if rng is None else {**inputs.kwargs, RNG: rng}
    leading = (params, model_state) if has_state else (params,)
    positional = (*leading, microbatch, *inputs.args)
    check_rng(signature, positional, kwargs, len(leading) + 1)
    try:
      out = loss_fn(*positional, **kwargs)
    except (TypeError, ValueError) as e:
      for hint in (_unsplit_args_hint(microbatch, inputs),
                   _stacked_batch_hint(microbatch, inputs)):
        if hint is not None:
          e.add_note(hint)
      raise
    if not (has_aux or has_state):
      return _unpaired(out), (None, None)
    if not isinstance(out, tuple) or len(out) != 2:
      raise ValueError(
          "loss_fn must return a pair (loss, aux) with has_aux=True or"
          f" has_state=True, got {_describe(out)}."
      )
    loss, rest = out
    loss = scalar(loss)
    if not has_state:
      return loss, (None, _arrays("aux", rest))
    if not has_aux:
      return loss, (_carried(model_state, rest), None)
    if not isinstance(rest, tuple) or len(rest) != 2:
      raise ValueError(
          "With has_state=True and has_aux=True, loss_fn must return"
          f" (loss, (new_model_state, aux)), got (loss, {type(rest).__name__})."
      )
    return loss, (_carried(model_state, rest[0]), _arrays("aux", rest[1]))

  return normalized


def _arrays(name: str, tree: Any) -> Any:
  """``tree``, or an error naming its first leaf that is not an array."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not is_array(leaf):
      raise TypeError(
          f"loss_fn's {name}{jax.tree_util.keystr(path)} is a"
          f" {type(leaf).__name__} ({shown(leaf)}): the {name} that loss_fn"
          " returns is carried through the micro-batch loop, so its leaves"
          " must be arrays or numbers. Return other values outside fn.")
  return tree


def _carried(model_state: Any, new: Any) -> Any:
  """``new``, or an error naming where it is not typed as ``model_state``:
  the loop carries it from one micro-batch to the next."""
  new = _arrays("new_model_state", new)
  why = " (it is carried from one micro-batch to the next)"
  if jax.tree.structure(new) != jax.tree.structure(model_state):
    raise TypeError(
        "loss_fn's new_model_state must have the structure of the"
        f" model_state it was given{why}: got {jax.tree.structure(new)},"
        f" given {jax.tree.structure(model_state)}.")
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(new),
                          jax.tree.leaves(model_state)):
    got, given = (jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v))
                  for v in (x, y))
    if got != given:
      raise TypeError(
          f"loss_fn's new_model_state{jax.tree_util.keystr(path)} is"
          f" {got.dtype}{list(got.shape)} where the model_state given holds"
          f" {given.dtype}{list(given.shape)}: it must keep each leaf's"
          f" shape and dtype{why}.")
  return new


def _signature(loss_fn) -> inspect.Signature | None:
  try:
    return inspect.signature(loss_fn)
  except (TypeError, ValueError):  # some builtins and C extensions.
    return None


def keyword_names(loss_fn) -> frozenset[str]:
  """The parameters ``loss_fn`` names and can take by keyword."""
  signature = _signature(loss_fn)
  if signature is None:
    return frozenset()
  return frozenset(
      name for name, p in signature.parameters.items()
      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _binds(signature: inspect.Signature, args, kwargs) -> bool:
  try:
    signature.bind(*args, **kwargs)
  except TypeError:
    return False
  return True


def _is_key(x: Any) -> bool:
  """A typed PRNG key, or a raw ``uint32[2]`` one (``jax.random.PRNGKey``)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return True
  return dtype == jnp.uint32 and jnp.shape(x) == (2,)


_PER_MICROBATCH = (
    " Call fn(params, batch, *args, rng=key): micro-batch i then gets its own"
    " key, passed to loss_fn as the keyword argument rng=."
)


def check_rng(signature, args, kwargs, num_fixed: int) -> None:
  """Raises naming ``rng=`` when ``loss_fn`` and the call disagree on it.

  ``args`` are the positional arguments ``loss_fn`` is about to get, the
  first ``num_fixed`` of them ours (``params``, the model state, the
  micro-batch), the rest the caller's ``*args``; ``kwargs`` include ``rng``
  when the caller gave a key. A call that fails for another reason is left
  to raise its own error.
  """
  if signature is None:
    return
  extra = args[num_fixed:]
  given = RNG in kwargs
  if not _binds(signature, args, kwargs):
    if not given and _binds(signature, args, {**kwargs, RNG: None}):
      raise TypeError(
          f"loss_fn needs a key (its parameter {RNG} has no default), but fn"
          " was called without rng=." +
          _PER_MICROBATCH)
    for i, arg in enumerate(extra):
      rest = args[:num_fixed] + extra[:i] + extra[i + 1:]
      if _is_key(arg) and _binds(signature, rest, {**kwargs, RNG: None}):
        raise TypeError(
            f"fn's positional argument {i} after the batch is a PRNG key that"
            f" loss_fn cannot take positionally: it takes {RNG} as a"
            " keyword." + _PER_MICROBATCH)
    if given and _binds(signature, args, {
        k: v for k, v in kwargs.items() if k != RNG}):
      raise TypeError(
          "fn was called with rng=, which goes on to loss_fn as the keyword"
          f" argument rng=, but loss_fn takes no {RNG} parameter: add one,"
          " e.g. loss_fn(params, microbatch, *, rng).")
    return
  bound = signature.bind(*args, **kwargs).arguments
  if not given and RNG in bound and _is_key(bound[RNG]):
    raise TypeError(
        f"loss_fn's {RNG} parameter would get a PRNG key passed positionally"
        " to fn, the same key for every micro-batch, so every micro-batch"
        " would draw the same random numbers (dropout masks)." +
        _PER_MICROBATCH)


def split_call_args(rest, has_state):
  """``(model_state, batch, args)`` from what follows ``params``."""
  if has_state:
    if len(rest) < 2:
      raise TypeError(
          "With has_state=True call fn(params, model_state, batch, *args)."
      )
    model_state, batch, *args = rest
    return model_state, batch, tuple(args)
  if not rest:
    raise TypeError("Call fn(params, batch, *args).")
  batch, *args = rest
  return None, batch, tuple(args)


def pack(result: Any, has_aux: bool, has_state: bool):
  """The caller's output, shaped like :func:`jax.value_and_grad`'s.

  ``result`` has fields ``loss``, ``grads``, ``model_state`` and ``aux``.
  """
  aux = result.aux
  if has_state and has_aux:
    value = (result.loss, (result.model_state, aux))
  elif has_state:
    value = (result.loss, result.model_state)
  elif has_aux:
    value = (result.loss, aux)
  else:
    value = result.loss
  return value, result.grads


