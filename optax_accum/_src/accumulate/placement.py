"""Where :func:`optax_accum.accumulate` may sit in an optax chain.

A wrapper that runs ``accumulate``'s ``update`` on some calls only and keeps
its old state on the others (``optax.apply_if_finite`` rejecting a
non-finite gradient) loses micro-steps silently: the rejected call never
reaches ``accumulate``, so every later window ends one micro-batch late (24
micro-batches meant as 6 updates of 4 become 5 updates and 3 micro-steps
left over). ``accumulate`` cannot see the rejection, so it refuses the
placement at ``init`` instead, where the wrapper's ``init`` calls it: the
frames above are looked at, nothing else.
"""

import sys
import types

import optax


def _closure_code(factory, name: str) -> types.CodeType | None:
  """The code of ``factory``'s inner function ``name`` (None if not found)."""
  code = getattr(factory, "__code__", None)
  if code is None:
    return None
  for const in code.co_consts:
    if isinstance(const, types.CodeType) and const.co_name == name:
      return const
  return None


# The init of each wrapper that may skip its inner's update.
_SKIPPING_INITS = {
    "optax.apply_if_finite": _closure_code(optax.apply_if_finite, "init"),
}

_MESSAGE = (
    "oa.accumulate inside {wrapper}: the wrapper skips accumulate's update"
    " on a non-finite gradient and keeps its old state, so the skipped"
    " micro-batch is not counted and every later update boundary shifts by"
    " one micro-batch. Drop the bad micro-batch inside accumulate instead:"
    " oa.accumulate(inner, every_k, skip_nonfinite=True) (the window still"
    " ends on time, without it), or wrap the inner optimizer:"
    " oa.accumulate({wrapper}(inner, max_consecutive_errors), every_k) (a"
    " window whose mean is not finite makes no update)."
)


def check_not_in_skipping_wrapper() -> None:
  """Raises if a wrapper that skips updates (see above) is initialising us."""
  codes = {code: name for name, code in _SKIPPING_INITS.items() if code}
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    wrapper = codes.get(frame.f_code)
    if wrapper is not None:
      raise ValueError(_MESSAGE.format(wrapper=wrapper))
    frame = frame.f_back
