"""FSDP memory policies: where a data-parallel loop gathers and syncs.

With parameters sharded over the data axes (FSDP, ZeRO-3), the micro-batch
loop can hold them and their gradient sum in two ways each:

* ``gather_params="once"``: all-gather the parameters before the loop and keep
  them whole through it (one all-gather per sharded leaf and update);
  ``"every_microbatch"``: keep the shards and all-gather inside the loop, for
  each micro-batch (``k`` per leaf and update, 1/N of the parameters held
  between micro-batches).
* ``gradient_sync="once"``: keep a whole-size partial gradient sum per device
  and reduce-scatter it after the loop (one per sharded leaf and update);
  ``"every_microbatch"``: reduce-scatter each micro-batch's weighted gradient
  into a sum sharded like the parameters (``k`` per leaf and update, 1/N of
  the gradient sum); ``"deferred"``: no reduction of the gradient over the
  data axes in this call (each device's partial comes back).

Both layouts with data axes read it: :mod:`manual_layout` and
:mod:`typed_layout`.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import readers

ONCE = "once"
EVERY_MICROBATCH = "every_microbatch"
DEFERRED = "deferred"  # gradient_sync only.
CHOICES = (ONCE, EVERY_MICROBATCH)


class Policy(NamedTuple):
  """Where a data-parallel loop gathers parameters and syncs gradients."""

  gradient_sync: str = ONCE  # "once", "every_microbatch" or "deferred".
  gather_params: str = ONCE  # "once" or "every_microbatch".

  def gathers_in_loop(self, sharded: bool) -> bool:
    """Whether a leaf (sharded over data axes or not) is gathered in the
    loop, for each micro-batch."""
    return sharded and self.gather_params == EVERY_MICROBATCH

  def syncs_in_loop(self, sharded: bool) -> bool:
    """Whether a leaf's gradient is reduce-scattered in the loop, for each
    micro-batch, into a sum sharded like it."""
    return sharded and self.gradient_sync == EVERY_MICROBATCH


def gathered_in_loop(leaves: list[Any], in_loop: list[bool], index: Any,
                     whole: Callable[[int, Any], Any]) -> list[Any]:
  """Leaves gathered in the loop: ``whole(i, shard)`` for each ``in_loop``.

  The shards first pass an optimization barrier with the micro-batch
  ``index``, so that XLA cannot hoist their gathers out of the loop (which
  would hold the whole parameters through it, the memory the policy saves).
  """
  shards = [i for i, flag in enumerate(in_loop) if flag]
  if not shards:
    return leaves
  tied, _ = lax.optimization_barrier(([leaves[i] for i in shards], index))
  leaves = list(leaves)
  for i, shard in zip(shards, tied):
    leaves[i] = whole(i, shard)
  return leaves


def policy(gradient_sync: Any, gather_params: Any) -> Policy:
  """A checked :class:`Policy`, or an error naming the bad argument."""
  for name, value, choices in (
      ("gradient_sync", gradient_sync, CHOICES + (DEFERRED,)),
      ("gather_params", gather_params, CHOICES)):
    if not isinstance(value, str) or value not in choices:
      raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
  return Policy(gradient_sync, gather_params)


def check_param_specs(param_specs: Any) -> Any:
  """Checks ``param_specs``: None, a PartitionSpec or a tree of them."""
  if param_specs is None:
    return None
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      param_specs, is_leaf=lambda x: isinstance(x, P)
  ):
    if not isinstance(leaf, P):
      raise TypeError(
          f"param_specs{jax.tree_util.keystr(path)} must be a"
          f" jax.sharding.PartitionSpec, got {leaf!r} of type"
          f" {type(leaf).__name__}."
      )
  return param_specs


def specs_like(params: Any, param_specs: Any,
               axis_name: readers.AxisName) -> Any:
  """``param_specs`` (a spec or a tree prefix) as one spec per parameter."""
  if isinstance(param_specs, P):
    spec = readers.restrict(param_specs, axis_name)
    return jax.tree.map(lambda _: spec, params)
  try:
    return jax.tree.map(
        lambda spec, sub: jax.tree.map(
            lambda _: readers.restrict(spec, axis_name), sub
        ),
        param_specs, params, is_leaf=lambda x: isinstance(x, P),
    )
  except ValueError as e:
    raise ValueError(
        "param_specs must be a PartitionSpec or a tree prefix of the"
        f" parameters' tree {jax.tree.structure(params)}, got {param_specs!r}."
    ) from e
