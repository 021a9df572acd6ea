"""Warnings that point at the caller's line, not ours.

Our warnings are raised deep inside a call (at trace time under
:func:`jax.jit`), and a fixed ``stacklevel`` names a line of ours, or of
JAX's, depending on the path taken. :func:`warn` walks the stack to the first
frame outside the libraries a call passes through (ours, JAX's, Flax's,
optax's, Equinox's, and the standard library's wrappers) and names it: the
line of the user's code that called us. Under :func:`jax.jit` that is the
line of the jitted function that called us, as it is traced.

Python 3.12's ``warnings.warn(skip_file_prefixes=...)`` does the same; this
module stands in for it on Python 3.11. Remove when Python >= 3.12 is the
minimum (``requires-python`` in ``pyproject.toml``): then call
``warnings.warn(message, category, skip_file_prefixes=...)`` with the
installed paths of the packages in ``_INTERNAL``.
"""

import sys
import warnings

# Top-level modules whose frames are never the caller's line.
_INTERNAL = frozenset({
    "optax_accum", "jax", "jaxlib", "flax", "optax", "equinox", "chex",
    "contextlib", "functools", "threading", "runpy",
})


def _is_internal(frame) -> bool:
  name = frame.f_globals.get("__name__") or ""
  return name.partition(".")[0] in _INTERNAL


def caller_stacklevel() -> int:
  """The ``stacklevel`` at which ``warnings.warn``, called by our caller,
  names the first frame outside ``_INTERNAL`` (or the outermost frame)."""
  frame = sys._getframe(2)  # the frame that called our caller.
  level = 2
  while frame.f_back is not None and _is_internal(frame):
    frame = frame.f_back
    level += 1
  return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn(message, category)`` at the caller's line.

  Args:
    message: the warning's text.
    category: its class, a subclass of :class:`Warning`.

  Examples:
    >>> import warnings
    >>> from optax_accum._src import caller_warnings
    >>> def library_call():  # imagine it in optax_accum
    ...   caller_warnings.warn("careful")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   library_call()
    >>> caught[0].message
    UserWarning('careful')
  """
  warnings.warn(message, category, stacklevel=caller_stacklevel())
