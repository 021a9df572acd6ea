"""Where each reduction of one computation starts and where it is done.

A computation's instructions, as a scheduled HLO module prints them, are in
the order they run. A reduction (an all-reduce or a reduce-scatter) takes
one of the three forms XLA prints: synchronous (one instruction), a start
and a done (GPU's ``all-reduce-start``/``all-reduce-done``,
``async-start``/``async-done`` around a reduce-scatter, ``async-update``
between) and XLA TPU's asynchronous collective fusions (``async_chains``:
a start fusion, continuations and a done fusion tied by ``chain_id``).
:mod:`overlap` reads the spans of the entry computation,
:mod:`model_loops` those of a model's loop bodies; both keep the
gradient-sized ones over the data axes (:func:`gradient_bytes`).
"""

import math
import re
from typing import Any, NamedTuple

from optax_accum._src.compiled import async_chains
from optax_accum._src.compiled import hlo_text
from optax_accum._src.compiled import step_reading

_REDUCTIONS = step_reading.REDUCTIONS
_CALLS = re.compile(r"\bcalls=%?([^\s,)]+)")
# XLA's GPU compiler turns a start and done with nothing between them back
# into a synchronous collective, saying so in the start's backend config.
_IS_SYNC = re.compile(r'"is_sync":true')


class Collective(NamedTuple):
  """The collective a reduction runs, read as ``hlo_text`` reads it."""

  name: str  # "all-reduce" or "reduce-scatter".
  rest: str  # its text from the opcode on: device groups, operands.
  shape_line: str  # the line whose result is its result.
  computation: str  # the computation it is an instruction of.


class Span(NamedTuple):
  """One reduction of a computation, from its start to its done."""

  name: str  # the instruction that starts it.
  collective: Collective
  asynchronous: bool  # a start and a done that other work may run between.
  start: int  # the index of the instruction that starts it.
  # The index of its done: ``start`` where synchronous, the computation's
  # length where the computation does not end it.
  done: int


class _Event(NamedTuple):
  """An instruction that starts, continues or ends a reduction."""

  role: str  # "sync", "start", "update" or "done".
  key: str  # what pairs a start with its done.
  collective: Collective | None  # on "sync" and "start".


def _collective(opcode: str, rest: str, line: str, computation: str,
                computations: dict[str, Any]) -> Collective | None:
  """The reduction that an instruction runs itself, or None."""
  # XLA TPU's reduce-scatter fusion (a reduce-scatter itself may name the
  # same emitter in its backend config).
  if opcode == "fusion" and hlo_text.is_reduce_scatter_fusion(line):
    callee = _CALLS.search(rest)
    inner = _reduction_in(callee.group(1) if callee else "", computations)
    return None if inner is None else inner._replace(
        name="reduce-scatter", shape_line=line)
  name = hlo_text.OPCODE_TO_COLLECTIVE.get(opcode)
  return Collective(name, rest, line, computation) if (
      name in _REDUCTIONS) else None


def _reduction_in(callee: str, computations: dict[str, Any]):
  """The first reduction that computation ``callee`` runs, or None."""
  for opcode, rest, line in computations.get(callee, ()):
    if found := _collective(opcode, rest, line, callee, computations):
      return found
  return None


def _event(opcode: str, rest: str, line: str, computation: str,
           computations: dict[str, Any]) -> _Event | None:
  """What the instruction does to a reduction, if anything."""
  name = hlo_text.instruction_name(line)
  operands = hlo_text.OPERANDS.match(rest)
  first = (operands.group(1).split(",")[0].split()[-1].lstrip("%")
           if operands and operands.group(1).strip() else "")
  if found := _collective(opcode, rest, line, computation, computations):
    asynchronous = opcode.endswith("-start") and not _IS_SYNC.search(rest)
    return _Event("start" if asynchronous else "sync", name, found)
  if opcode.endswith("-done") and opcode[:-len("-done")] in _REDUCTIONS:
    return _Event("done", first, None)
  if opcode in ("async-update", "async-done"):
    return _Event(opcode[len("async-"):], first, None)
  callee = _CALLS.search(rest)
  if callee is None or opcode not in ("async-start", "fusion"):
    return None
  found = _reduction_in(callee.group(1), computations)
  if found is None:
    return None
  if opcode == "async-start":
    return _Event("start", name, found)
  role = async_chains.async_fusion_role(callee.group(1), computations)
  chain = async_chains.chain_id(found.rest)
  if role is None or chain is None:
    return None  # a continuation: compute with the collective's next steps.
  return _Event(role.lower(), f"chain {chain}",
                found if role == "Start" else None)


def spans(computation: str, computations: dict[str, Any]) -> list[Span]:
  """Each reduction of ``computation``, in the order they start."""
  open_at, key_of, found = {}, {}, []
  instructions = computations[computation]
  for i, (opcode, rest, line) in enumerate(instructions):
    event = _event(opcode, rest, line, computation, computations)
    if event is None:
      continue
    key = key_of.get(event.key, event.key)
    if event.role == "sync":
      found.append([event, i, i])
    elif event.role == "start":
      found.append([event, i, len(instructions)])
      open_at[key] = found[-1]
    elif event.role == "update":
      key_of[hlo_text.instruction_name(line)] = key
    elif key in open_at:
      open_at.pop(key)[2] = i
  return [Span(hlo_text.instruction_name(instructions[start][2]),
               event.collective, event.role == "start", start, done)
          for event, start, done in found]


def gradient_bytes(span: Span, computations: dict[str, Any], positions: Any,
                   mesh: Any, data_axes: tuple[str, ...] | None) -> int | None:
  """The bytes of a span's result (as ``count_collectives`` counts them),
  or None where it sums scalars (a loss, a token count) or spans none of
  ``data_axes`` (None: any axis counts)."""
  found = span.collective
  shapes = hlo_text.result_shapes(found.shape_line)
  if hlo_text.is_scalar_sum(found.rest, shapes, found.computation,
                            computations):
    return None
  if mesh is not None and data_axes is not None and not set(
      hlo_text.collective_axes(found.rest, positions, mesh)) & set(data_axes):
    return None
  return sum(hlo_text.ITEMSIZE[t] * math.prod(d) for t, d in shapes)
