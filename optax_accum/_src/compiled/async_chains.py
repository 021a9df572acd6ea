"""XLA TPU's asynchronous collective fusions, read from a program's text.

With its asynchronous collective flags (``docs/performance.md``, "Hiding
the one reduction"), libtpu 0.0.42 writes an all-reduce as a chain of
fusions: one whose computation ends in the custom-call
``AsyncCollectiveStart``, continuations (compute fused with the
collective's next steps) and one ending in ``AsyncCollectiveDone``, each
holding a copy of the collective, tagged with the chain's id. The chain
runs the collective once: :mod:`hlo_text` counts it at its start,
:mod:`overlap` reads where the chain starts and ends.
"""

import re
from typing import Any

_ASYNC_FUSION_ROLE = re.compile(
    r'custom_call_target="AsyncCollective(Start|Done)"')
_CHAIN_ID = re.compile(r'\bchain_id="(\d+)"')


def async_fusion_role(computation: str,
                      computations: dict[str, Any]) -> str | None:
  """"Start" or "Done" where ``computation`` is the start or the done of XLA
  TPU's asynchronous collective fusion (its custom-call says which), else
  None."""
  for _, _, line in computations.get(computation, ()):
    if match := _ASYNC_FUSION_ROLE.search(line):
      return match.group(1)
  return None


def chain_id(rest: str) -> str | None:
  """The ``chain_id`` that ties a collective to its asynchronous collective
  fusion's chain, or None."""
  match = _CHAIN_ID.search(rest)
  return None if match is None else match.group(1)


def is_chain_copy(rest: str, computation: str,
                  computations: dict[str, Any]) -> bool:
  """Whether a collective is XLA TPU's copy of a chain's collective, in a
  continuation or the done: the chain runs it once, counted at its start."""
  return (chain_id(rest) is not None
          and async_fusion_role(computation, computations) != "Start")
