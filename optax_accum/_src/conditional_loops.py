"""Work run where a predicate holds, as loops that differentiate as conds.

Two forms, for two places where a ``lax.cond`` costs memory that a loop
does not:

* :func:`run_if`: ``lax.cond(pred, body, lambda x: x, init)`` written as a
  loop of at most one trip (``oa.update_and_apply``'s emit). A while loop's
  carry lives in one buffer that its body updates in place, while a
  conditional's pass-through branch may be a copy: XLA's GPU compiler copies
  a donated parameter that a ``lax.cond`` hands back untouched (a donated
  ``update_and_apply`` micro-step compiled for an H100 peaks at
  ``optax.MultiSteps``'s as this loop, higher as a conditional:
  ``docs/performance.md``, "The per-call step").
* :func:`scan_if`: ``n`` trips of a body as one ``lax.scan``, which
  differentiates as trips where ``pred`` holds and none where it fails
  (``oa.value_and_grad``'s loop where an empty micro-batch borrows).

Differentiated, each is the conditional (a custom JVP, one for both): a loop
of dynamic trip count has no reverse mode, a conditional has both. The
values a body closes over are made arguments (``jax.closure_convert``), so
that their derivatives are kept.
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

from optax_accum._src import names


def per_compiler(branched: Callable[[], Any], looped: Callable[[], Any],
                 cpu: Callable[[], Any] | None = None) -> Any:
  """``looped()`` on GPUs, ``branched()`` on TPU and CPU (or ``cpu()``
  there, given one), by the platform the program is lowered for
  (``lax.platform_dependent``).

  For the emit choice where what it hands back rides in the carry
  (``accumulate/emit.py``): on a GPU a conditional copies what it passes
  through; on a TPU the loop peaked higher at small sizes, on the CPU it ran
  an adamw cycle slower (``docs/performance.md``, "The per-call step").
  """
  return lax.platform_dependent(tpu=branched, cpu=cpu or branched,
                                default=looped)


def run_if(pred: jax.Array, body: Callable[..., Any], init: Any,
           *operands: Any) -> Any:
  """``body(init, *operands)`` where the scalar bool ``pred`` holds, else
  ``init``.

  ``body`` must return a tree typed like ``init`` (shapes, dtypes,
  shardings), as both branches of a ``lax.cond`` must. ``operands`` are only
  read: they pass an optimization barrier with the loop's own predicate, so
  that nothing computed from them alone is loop-invariant. XLA hoists
  loop-invariant work (a reduction of the gradient sum over the devices
  included) out of a loop, where it would run on every call.
  """
  body, consts = jax.closure_convert(body, init, *operands)

  def once(pred, init, operands, consts):
    def trip(carry):
      go, x = carry
      # The barrier's copy of go is dropped: it may be typed varying over
      # more manual axes than pred (a barrier unifies them).
      _, reads = lax.optimization_barrier((go, operands))
      return ~go, body(x, *reads, *consts)  # ~go: False, typed like pred.

    with jax.named_scope(names.AT_MOST_ONCE_SCOPE):
      return lax.while_loop(lambda carry: carry[0], trip, (pred, init))[1]

  def branch(x, operands, consts):
    return body(x, *operands, *consts)

  return _looped(once, branch, pred, init, (operands, consts))


def trips(body: Callable[..., Any], start: Any, stop: Any, init: Any,
          *consts: Any) -> Any:
  """``body(carry, index, *consts)`` for ``index`` in ``[start, stop)``: a
  ``lax.while_loop`` on ``index < stop``. With ``stop`` a constant, its
  condition says how many times it runs at most (``oa.check_train_step``
  reads it there). Not differentiable in reverse mode."""
  def trip(state):
    index, carry = state
    return index + 1, body(carry, index, *consts)

  return lax.while_loop(lambda state: state[0] < stop, trip,
                        (jnp.asarray(start, jnp.int32), init))[1]


def scan_if(pred: jax.Array, body: Callable[[Any, jax.Array], Any],
            num_trips: int, init: Any) -> Any:
  """``body(carry, index)`` for ``index`` in ``range(num_trips)``: one
  ``lax.scan``, whatever the scalar bool ``pred`` says. Differentiated,
  ``lax.cond(pred, that scan, identity)``: where ``pred`` fails, the trips
  have no derivative, and the caller drops what they computed
  (``oa.value_and_grad``'s loop where an empty micro-batch borrows: with no
  tokens at all, its mean is zero whatever its sums hold).

  Not a loop from ``where(pred, 0, n)`` to ``n``, nor a conditional around
  the scan: XLA's TPU compiler held more memory for either (TPU v5e, the
  16-layer decoder of benchmark q on a data x tensor mesh: 251.0 and 250.3
  MiB against 231.1 MiB as a scan, the hand-written scan's peak).
  """
  body, consts = jax.closure_convert(body, init, jnp.int32(0))

  def branch(carry, consts):
    return lax.scan(lambda c, i: (body(c, i, *consts), None), carry,
                    jnp.arange(num_trips))[0]

  return _looped(lambda pred, init, consts: branch(init, consts), branch,
                 pred, init, (consts,))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _looped(looped, branch, pred, init, args):
  """``looped(pred, init, *args)``; differentiated, ``lax.cond(pred,
  branch(., *args), identity, init)``."""
  del branch
  return looped(pred, init, *args)


@_looped.defjvp
def _looped_jvp(looped, branch, primals, tangents):
  del looped
  pred, init, args = primals
  _, init_dot, args_dot = tangents

  def branched(init, args):
    return lax.cond(pred, lambda x: branch(x, *args), lambda x: x, init)

  return jax.jvp(branched, (init, args), (init_dot, args_dot))
