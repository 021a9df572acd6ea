"""The gradient reductions inside a model's own loops, as scheduled.

A model that scans its stacked layers through :func:`optax_accum.scan_layers`
reduces each layer's slice of a stacked leaf's gradient inside the backward
loop of its last micro-batch: one reduction per trip, which XLA may run
beside the next layer's backward. :mod:`overlap` reads these beside the
entry computation's. A loop here is any ``while`` but the micro-batch loop
and the loops inside it (``step_reading.microbatch_loops``:
``oa.value_and_grad``'s, by its named scope; without it, an outermost loop
whose trip count XLA does not know, as a hand-written one may be). Its
body's reductions are read in the forms ``reduction_spans`` reads, and one
runs as many times per step as the loop's trip count, times those of the
loops around it (once for a loop whose count is not known), as
``oa.check_train_step`` counts it. A reduction whose done the body does not
hold (XLA's pipelined all-reduce, done in the next trip) spans the rest of
the body.
"""

import math
import re
from typing import Any, NamedTuple

from optax_accum._src.compiled import hlo_text
from optax_accum._src.compiled import matmul_flops
from optax_accum._src.compiled import reduction_spans
from optax_accum._src.compiled import step_reading

_BODY = re.compile(r"\bbody=%?([^\s,)]+)")


class LoopReduction(NamedTuple):
  """One gradient-sized reduction in the body of a model's loop."""

  name: str  # the instruction that starts it, as the HLO text names it.
  collective: str  # "all-reduce" or "reduce-scatter".
  nbytes: int  # of its result, one trip's.
  trips: int  # how many times it runs per step.
  asynchronous: bool  # a start and a done that other work may run between.
  flops_between: int  # of the matrix multiplies between start and done.
  loop: str  # the while instruction whose body holds it.

  @property
  def overlapped(self) -> bool:
    """Asynchronous, with a matrix multiply of the loop's body between its
    start and its done."""
    return self.asynchronous and self.flops_between > 0

  @property
  def total_bytes(self) -> int:
    """Its bytes over the step: one trip's times the trips."""
    return self.nbytes * self.trips


class _Body(NamedTuple):
  computation: str  # the body's.
  loop: str  # the while instruction's name.
  trips: int  # how many times the body runs per step.


def _model_loop_bodies(entry: str, computations: dict[str, Any]):
  """The body of each loop outside the micro-batch loop, once each."""
  instructions = list(step_reading.walk(entry, computations))
  microbatch = {loop.name for loop in step_reading.microbatch_loops(
      instructions, computations, None)}
  whiles = [inst for inst in instructions if inst.opcode == "while"]
  trips = {hlo_text.instruction_name(inst.line):
           step_reading.trip_count(inst.rest, computations) or 1
           for inst in whiles}
  bodies = {}
  for inst in whiles:
    name = hlo_text.instruction_name(inst.line)
    body = _BODY.search(inst.rest)
    if body is None or name in microbatch or set(inst.loops) & microbatch:
      continue
    bodies.setdefault(body.group(1), _Body(
        body.group(1), name,
        trips[name] * math.prod(trips.get(loop, 1) for loop in inst.loops)))
  return list(bodies.values())


def read(entry: str, computations: dict[str, Any],
         flops: matmul_flops.Counter, positions: Any, mesh: Any,
         data_axes: tuple[str, ...] | None,
         min_bytes: int) -> tuple[LoopReduction, ...]:
  """The gradient-sized reductions over ``data_axes`` (None: any) in the
  bodies of the model's loops of the program ``computations`` holds, each
  of at least ``min_bytes`` per trip."""
  found = []
  for body in _model_loop_bodies(entry, computations):
    instructions = computations.get(body.computation, ())
    for span in reduction_spans.spans(body.computation, computations):
      nbytes = reduction_spans.gradient_bytes(span, computations, positions,
                                              mesh, data_axes)
      if nbytes is None or nbytes < min_bytes:
        continue
      between = sum(flops.of_instruction(opcode, rest, line,
                                         body.computation)[0]
                    for opcode, rest, line in
                    instructions[span.start + 1:span.done])
      found.append(LoopReduction(
          span.name, span.collective.name, nbytes, body.trips,
          span.asynchronous, between, body.loop))
  return tuple(found)


def why_not_hidden(reductions: tuple[LoopReduction, ...],
                   share) -> tuple[str, ...]:
  """The line for the asynchronous reductions inside loops that are not
  hidden, if any; ``share(nbytes)`` words their part of all the bytes."""
  bare = [r for r in reductions if r.asynchronous and not r.overlapped]
  if not bare:
    return ()
  return (
      f"{share(sum(r.total_bytes for r in bare))} in"
      f" {sum(r.trips for r in bare)} reductions inside a model's loop with"
      " no matrix multiply between their start and done: XLA scheduled"
      " nothing of the loop's body beside them.",)


def summary(reductions: tuple[LoopReduction, ...]) -> str:
  """A line on the reductions inside loops, for the printed report."""
  runs = sum(r.trips for r in reductions)
  where = "a loop body" if len(reductions) == 1 else "loop bodies"
  return (
      f"{runs} of those inside a model's loop ({len(reductions)} in"
      f" {where}, run once per trip):"
      f" {sum(r.trips for r in reductions if r.asynchronous)} asynchronous,"
      f" {sum(r.trips for r in reductions if r.overlapped)} with a matrix"
      " multiply between start and done")
