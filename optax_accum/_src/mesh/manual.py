"""Per-device code: the one module that enters :func:`jax.shard_map`.

Some steps are written on each device's own blocks: the arithmetic JAX has
no rules for on unreduced arrays, the collectives of the manual and auto
forms, the typed form's per-device noise-scale rows. They all enter manual
mode here, so that a change of ``jax.shard_map``'s signature touches one
module.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src.mesh import readers


def shard_map(fn: Callable[..., Any], *, in_specs: Any, out_specs: Any,
              axis_names: set[str] | None = None, mesh: Any = None,
              check_vma: bool = True) -> Callable[..., Any]:
  """:func:`jax.shard_map` of ``fn``: the package's one call of it."""
  kwargs = {} if mesh is None else {"mesh": mesh}
  if axis_names is not None:
    kwargs["axis_names"] = axis_names
  return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma, **kwargs)


def on_own_partials(fn: Callable[..., Any], args: tuple[Any, ...],
                    out_specs: Any) -> Any:
  """``fn(*args)`` on each device's own blocks: every mesh axis manual.

  Each argument leaf is split as its type says: an unreduced leaf arrives
  as the device's partial, a plain array. JAX takes unreduced specs only
  with every axis manual, and its type checker sees a partial as neither
  invariant nor varying (``check_vma=False``).

  JAX has no unreduced rules for most arithmetic (a product with a
  replicated scalar, ``where``, ``isfinite``, ``div``), so the deferred
  forms write theirs on each device's blocks. Remove when those rules exist
  (with its callers' own "Remove when" notes).
  """
  return shard_map(
      fn, in_specs=jax.tree.map(readers.full_spec, args), out_specs=out_specs,
      axis_names=set(jax.sharding.get_abstract_mesh().axis_names),
      check_vma=False,
  )(*args)


def on_first_device(x: jax.Array, over: readers.AxisName) -> jax.Array:
  """Per device: ``x`` on the first device of ``over``, zeros elsewhere.

  A value that is the same on every device enters a per-device partial sum
  this way: summed over ``over`` it counts once.
  """
  return jnp.where(is_first_device(over), x, jnp.zeros_like(x))


def is_first_device(over: readers.AxisName) -> jax.Array:
  """Per device: whether this is device 0 of the axes ``over``."""
  return lax.axis_index(readers.axes_of(over)) == 0


def any_device(flag: jax.Array, over: readers.AxisName) -> jax.Array:
  """Per device: whether ``flag`` holds on any device of ``over``."""
  return lax.psum(flag.astype(jnp.int32), readers.axes_of(over)) > 0
