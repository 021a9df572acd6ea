"""Keyword arguments from other libraries, named with ours.

A port from ``optax.MultiSteps``, Hugging Face or a hand-written loop brings
its own names (``use_grad_mean``, ``every_k_schedule``, ``num_tokens`` where
we take ``num_tokens_fn``). Python's bare "unexpected keyword argument" does
not say what to write instead; :func:`takes_only_own_keywords` checks the
names before the call and says it.
"""

from collections.abc import Callable
import difflib
import functools
import inspect
from typing import Any

_Factory = Callable[..., Any]


def takes_only_own_keywords(
    others: dict[str, str]) -> Callable[[_Factory], _Factory]:
  """Wraps a public factory so that a keyword it does not take is named.

  Args:
    others: a name from another library (or a likely slip), mapped to what
      to write here instead.

  Returns:
    A decorator; the function it wraps keeps its signature.
  """

  def wrap(fn: _Factory) -> _Factory:
    own = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
      for name in kwargs:
        if name not in own:
          raise TypeError(_unknown(fn.__name__, name, own, others))
      return fn(*args, **kwargs)

    return checked

  return wrap


def _unknown(call: str, name: str, own: tuple[str, ...],
             others: dict[str, str]) -> str:
  if name in others:
    return (f"optax_accum.{call} takes no argument {name!r}: {others[name]}")
  close = difflib.get_close_matches(name, own, n=1, cutoff=0.6)
  hint = f" Did you mean {close[0]!r}?" if close else ""
  return (f"optax_accum.{call} takes no argument {name!r}.{hint} Its"
          f" arguments are {', '.join(own)}.")
