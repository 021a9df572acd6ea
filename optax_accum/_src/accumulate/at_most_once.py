"""A computation run where a predicate holds: a loop of at most one trip.

``run_if(pred, body, init)`` is ``lax.cond(pred, body, lambda x: x, init)``
written as a ``lax.while_loop`` that runs ``body`` once or not at all. A
while loop's carry lives in one buffer that its body updates in place, while
a conditional's pass-through branch may be a copy: XLA's GPU compiler copies
a donated parameter that a ``lax.cond`` hands back untouched (with
``optax.adamw`` on 512 MiB of parameters, compiled for one H100, a donated
``update_and_apply`` micro-step peaked at 4096 MiB as a conditional and at
2560 MiB, ``optax.MultiSteps``'s, as this loop). CPU programs are the same
either way; on TPU the loop peaked higher at small sizes, so there the
emitting step's inner choice stays a conditional (``per_compiler``).

Differentiated, it is the conditional (a custom JVP): a loop of dynamic
trip count has no reverse mode. The loop is named :data:`SCOPE`, so that the
readers of compiled programs (``oa.count_collectives``,
``oa.check_train_step``) count what runs in it as in a branch, not once per
iteration of a loop.
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
from jax import lax

# The named scope of the loop, as the op_name metadata of the program has it.
SCOPE = "optax_accum_at_most_once"


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

  Differentiated (``jax.grad``, ``jax.jvp``), it is the ``lax.cond``: a
  loop of dynamic trip count has no reverse mode, a conditional has both.
  The values ``body`` closes over are made arguments
  (``jax.closure_convert``), so that their derivatives are kept.
  """
  body, consts = jax.closure_convert(body, init, *operands)
  return _run_if(body, pred, init, operands, consts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _run_if(body, pred, init, operands, consts):
  def once(carry):
    go, x = carry
    # The barrier's copy of go is dropped: it may be typed varying over
    # more manual axes than pred (a barrier unifies them).
    _, reads = lax.optimization_barrier((go, operands))
    return ~go, body(x, *reads, *consts)  # ~go: False, typed like pred.

  with jax.named_scope(SCOPE):
    return lax.while_loop(lambda carry: carry[0], once, (pred, init))[1]


@_run_if.defjvp
def _run_if_jvp(body, primals, tangents):
  pred, *args = primals
  _, *args_dot = tangents

  def branched(init, operands, consts):
    return lax.cond(pred, lambda x: body(x, *operands, *consts),
                    lambda x: x, init)

  return jax.jvp(branched, tuple(args), tuple(args_dot))


def per_compiler(branched: Callable[[], Any], looped: Callable[[], Any]) -> Any:
  """``looped()`` on GPUs, ``branched()`` on TPU and CPU, by the platform
  the program is lowered for (``lax.platform_dependent``).

  For ``oa.update_and_apply``'s choice of running the inner optimizer: on a
  TPU the loop peaked higher at small sizes (148 against 80 MiB, adamw, 16
  MiB of parameters), on the CPU it is the same. ``tx.update`` and
  ``oa.apply_if_updated`` stay conditionals everywhere: as loops on GPUs
  they peaked lower with the gradients passed in (adamw 3072 against 4096
  MiB, Muon 3648 against 4160: benchmark o) but higher in a train step that
  computes them (9729 against 9281 MiB per H100 at 1B: benchmark k), and on
  the CPU ran a k = 8 adamw cycle 1.7x slower.
  """
  return lax.platform_dependent(tpu=branched, cpu=branched, default=looped)
