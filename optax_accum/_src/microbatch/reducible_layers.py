"""A bias add and a feature scale that JAX can type ``reduced``, and layers.

Under :func:`jax.jit` with Explicit data axes the typed micro-batch loop
casts each parameter to ``reduced`` over the data axes, so that its gradient
comes out ``unreduced`` (each device's partial sum) and is reduced once per
call. JAX refuses a ``reduced`` operand in an elementwise operation with an
operand sharded over those axes, ``x + bias`` or ``x * scale`` on
batch-sharded activations, so such a leaf falls back to a reduction per
micro-batch (:mod:`reduced_fallbacks`). Written as a contraction-free
:func:`jax.numpy.einsum` against an operand sharded like ``x``, the same
arithmetic is typed: the transpose sums over the batch as a contraction, and
its result is ``unreduced``.

:func:`add_bias` and :func:`multiply_scale` are those two operations, for
any model; :func:`reducible_layers` swaps Flax NNX's and Equinox's
``Linear`` and ``LayerNorm`` in a model for subclasses that use them, so
that a model built from them needs no rewrite.
"""

import dataclasses
import functools
import importlib.util
import string
from typing import Any

import jax
import jax.numpy as jnp


def _as_array(x: Any) -> Any:
  """Lists and scalars as arrays; arrays and tracers as they are (jax 0.9's
  ``jnp.asarray`` of a vmapped, sharded tracer re-applies its sharding to
  one example's shape)."""
  return x if isinstance(x, (jax.Array, jax.core.Tracer)) else jnp.asarray(x)


def _check_trailing(x: Any, factor: Any, name: str) -> None:
  """Raises unless ``factor`` is shaped like ``x``'s trailing axes."""
  x_shape, shape = jnp.shape(x), jnp.shape(factor)
  if len(shape) > len(x_shape) or x_shape[len(x_shape) - len(shape):] != shape:
    raise ValueError(
        f"{name} of shape {shape} must be shaped like the trailing axes of x,"
        f" of shape {x_shape} (a bias or scale of the last axis has shape"
        f" {x_shape[-1:]})."
    )


def _times(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` over ``x``'s trailing axes, as an einsum."""
  dims = string.ascii_letters[:jnp.ndim(factor)]
  return jnp.einsum(f"...{dims},{dims}->...{dims}", x, factor)


def multiply_scale(x: jax.Array, scale: jax.Array) -> jax.Array:
  """``x * scale``, ``scale`` over ``x``'s trailing axes, typed ``reduced``.

  The same value as ``x * scale`` (a norm layer's learned scale), written
  as an einsum so that under :func:`jax.jit` with Explicit data axes JAX
  accepts ``scale`` typed ``reduced`` over the axes that shard ``x``: its
  gradient is then reduced once per call of
  :func:`optax_accum.value_and_grad`, not in every micro-batch. Works on
  one example under :func:`jax.vmap` (Equinox) as on a batch.

  Args:
    x: the activations, e.g. ``(batch, seq, features)``.
    scale: the factor, shaped like the trailing axes of ``x``.

  Returns:
    ``x * scale``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_accum as oa
    >>> oa.multiply_scale(jnp.ones((2, 3)), jnp.array([1.0, 2.0, 3.0]))
    Array([[1., 2., 3.],
           [1., 2., 3.]], dtype=float32)
  """
  x, scale = _as_array(x), _as_array(scale)
  _check_trailing(x, scale, "scale")
  return _times(x, scale)


def add_bias(x: jax.Array, bias: jax.Array) -> jax.Array:
  """``x + bias``, ``bias`` over ``x``'s trailing axes, typed ``reduced``.

  The same value as ``x + bias`` (a layer's bias, a positional embedding),
  written so that under :func:`jax.jit` with Explicit data axes JAX accepts
  ``bias`` typed ``reduced`` over the axes that shard ``x``: ``bias`` is
  broadcast by an einsum against ones laid out like ``x``, so its gradient
  is a contraction over the batch, reduced once per call of
  :func:`optax_accum.value_and_grad`, not in every micro-batch. XLA folds
  the ones away. Works on one example under :func:`jax.vmap` (Equinox) as
  on a batch.

  Args:
    x: the activations, e.g. ``(batch, seq, features)``.
    bias: the addend, shaped like the trailing axes of ``x``.

  Returns:
    ``x + bias``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_accum as oa
    >>> oa.add_bias(jnp.zeros((2, 3)), jnp.array([1.0, 2.0, 3.0]))
    Array([[1., 2., 3.],
           [1., 2., 3.]], dtype=float32)
  """
  x, bias = _as_array(x), _as_array(bias)
  _check_trailing(x, bias, "bias")
  # Ones that vary like x: under jax.vmap, jnp.ones_like(x) alone is one
  # example's constant, and the einsum would not be batched over the axes
  # that shard x. The select reads no value of x (no NaN from an inf).
  ones = jnp.where(True, jnp.ones_like(x), x)
  return x + _times(ones, bias).astype(jnp.result_type(x, bias))


# Flax NNX.


@functools.cache
def _nnx_classes() -> dict[type, type]:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from flax.nnx.nn import normalization  # pylint: disable=g-import-not-at-top

  class Linear(nnx.Linear):
    """``nnx.Linear`` whose bias is added by :func:`add_bias`."""

    def __call__(self, inputs, out_sharding=None):
      kernel = self.kernel[...]
      bias = self.bias[...] if self.bias is not None else None
      inputs, kernel, bias = self.promote_dtype(
          (inputs, kernel, bias), dtype=self.dtype)
      kwargs = {"out_sharding": out_sharding}
      if self.preferred_element_type is not None:
        kwargs["preferred_element_type"] = self.preferred_element_type
      y = self.dot_general(
          inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
          precision=self.precision, **kwargs)
      return y if bias is None else add_bias(y, bias)

  class LayerNorm(nnx.LayerNorm):
    """``nnx.LayerNorm`` whose scale and bias use :func:`multiply_scale`
    and :func:`add_bias` (features on the last axis; else as Flax's)."""

    def __call__(self, x, *, mask=None):
      features = self.feature_axes
      features = (features,) if isinstance(features, int) else features
      if tuple(features) not in ((-1,), (x.ndim - 1,)):
        return super().__call__(x, mask=mask)
      scale = self.scale[...] if self.scale else None
      bias = self.bias[...] if self.bias else None
      x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
      mean, var = normalization._compute_stats(  # pylint: disable=protected-access
          x, self.reduction_axes, self.dtype, self.axis_name,
          self.axis_index_groups, use_fast_variance=self.use_fast_variance,
          mask=mask)
      y = normalization._normalize(  # pylint: disable=protected-access
          x, mean, var, None, None, self.reduction_axes, self.feature_axes,
          self.dtype, self.epsilon)
      if scale is not None:
        y = multiply_scale(y, scale)
      if bias is not None:
        y = add_bias(y, bias)
      return y

  return {nnx.Linear: Linear, nnx.LayerNorm: LayerNorm}


def _nnx_swap(model: Any) -> Any:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  classes = _nnx_classes()
  for _, node in nnx.iter_graph(model):
    if type(node) in classes:
      node.__class__ = classes[type(node)]
  return model


# Equinox.

_NO_STATE = object()  # LayerNorm called without a state.


@functools.cache
def _eqx_classes() -> dict[type, type]:
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class Linear(eqx.nn.Linear):
    """``eqx.nn.Linear`` whose bias is added by :func:`add_bias`."""

    def __call__(self, x, *, key=None):
      del key
      if self.in_features == "scalar":
        x = jnp.broadcast_to(x, (1,))
      y = self.weight @ x
      if self.bias is not None:
        y = add_bias(y, self.bias)
      return jnp.squeeze(y) if self.out_features == "scalar" else y

  class LayerNorm(eqx.nn.LayerNorm):
    """``eqx.nn.LayerNorm`` whose weight and bias use
    :func:`multiply_scale` and :func:`add_bias`."""

    def __call__(self, x, state=_NO_STATE, *, key=None):
      del key
      if x.shape != self.shape:  # Equinox's own error.
        return super().__call__(x) if state is _NO_STATE else (
            super().__call__(x, state))
      dtype = jnp.result_type(x.dtype, jnp.float32)
      y = x.astype(dtype)
      mean = jnp.mean(y, keepdims=True)
      variance = jnp.maximum(0.0, jnp.var(y, keepdims=True))
      y = (y - mean) * jax.lax.rsqrt(variance + self.eps)
      if self.use_weight:
        y = multiply_scale(y, self.weight.astype(dtype))
      if self.use_bias:
        y = add_bias(y, self.bias.astype(dtype))
      y = y.astype(x.dtype)
      return y if state is _NO_STATE else (y, state)

  return {eqx.nn.Linear: Linear, eqx.nn.LayerNorm: LayerNorm}


def _retyped(module: Any, cls: type) -> Any:
  """An Equinox module of class ``cls`` with ``module``'s fields."""
  new = object.__new__(cls)
  for field in dataclasses.fields(module):
    object.__setattr__(new, field.name, getattr(module, field.name))
  return new


def _eqx_swap(model: Any) -> Any:
  classes = _eqx_classes()
  is_layer = lambda x: type(x) in classes
  return jax.tree.map(
      lambda x: _retyped(x, classes[type(x)]) if is_layer(x) else x,
      model, is_leaf=is_layer)


def _is_nnx(model: Any) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(model, nnx.Module)


def reducible_layers(model: Any) -> Any:
  """The model with its Linear and LayerNorm layers' bias and scale typed
  ``reduced``: their gradient reduced once per call, not per micro-batch.

  Flax NNX's ``nnx.Linear`` and ``nnx.LayerNorm`` and Equinox's
  ``eqx.nn.Linear`` and ``eqx.nn.LayerNorm`` add their bias and multiply
  their scale elementwise, which JAX does not type ``reduced`` on
  batch-sharded activations: in :func:`optax_accum.value_and_grad`'s typed
  loop (under :func:`jax.jit` with Explicit data axes) those leaves fall
  back to a gradient reduction in every micro-batch, and the first trace
  warns (:func:`optax_accum.sharding_report` lists them). This swaps each
  such layer for a subclass that does the same arithmetic with
  :func:`add_bias` and :func:`multiply_scale`: same parameters, same
  outputs, and the fallback is gone. Other layers are left as they are.

  An NNX model is changed in place (its layers' classes) and returned; an
  Equinox model (or any pytree holding Equinox layers) is returned anew.
  Call it on the model before splitting it (``nnx.split``,
  ``eqx.partition``).

  Args:
    model: an ``nnx.Module``, or an Equinox module or pytree of them.

  Returns:
    The model with its layers swapped.

  Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import optax_accum as oa
    >>> model = oa.reducible_layers(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    >>> isinstance(model, nnx.Linear), model(jnp.ones((4, 3))).shape
    (True, (4, 2))
  """
  if _is_nnx(model):
    return _nnx_swap(model)
  if importlib.util.find_spec("equinox") is None:
    return model
  return _eqx_swap(model)
