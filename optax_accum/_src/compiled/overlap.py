"""How much of a step's gradient reduction overlaps its last backward.

:func:`reduction_overlap` reads the scheduled HLO of a compiled program
(``compiled.as_text()``, ``is_scheduled=true``: the entry computation's
instructions in the order they run) on ``hlo_text``'s parser. For each
gradient-sized all-reduce and reduce-scatter of the entry computation it
finds where it starts and where it is done, in the three forms XLA prints:
synchronous (one instruction), a start and a done (GPU's
``all-reduce-start``/``all-reduce-done``, ``async-start``/``async-done``
around a reduce-scatter) and XLA TPU's asynchronous collective fusions (a
``fusion`` whose computation ends in the custom-call
``AsyncCollectiveStart``, later ones holding the same collective under the
same ``chain_id``, the last ending in ``AsyncCollectiveDone``). The matrix
multiplies and their flops are ``matmul_flops``'.
"""

import math
import re
from typing import Any, NamedTuple

from optax_accum._src import validation
from optax_accum._src.compiled import async_chains
from optax_accum._src.compiled import hlo
from optax_accum._src.compiled import hlo_text
from optax_accum._src.compiled import matmul_flops
from optax_accum._src.compiled import step_reading

_REDUCTIONS = step_reading.REDUCTIONS
_CALLS = re.compile(r"\bcalls=%?([^\s,)]+)")
# XLA's GPU compiler turns a start and done with nothing between them back
# into a synchronous collective, saying so in the start's backend config.
_IS_SYNC = re.compile(r'"is_sync":true')
_SCHEDULED = re.compile(r"^HloModule\s.*\bis_scheduled=true", re.MULTILINE)
_MODULE = re.compile(r"^HloModule\s", re.MULTILINE)


class ScheduledReduction(NamedTuple):
  """One gradient-sized reduction of the entry computation, as scheduled."""

  name: str  # the instruction that starts it, as the HLO text names it.
  collective: str  # "all-reduce" or "reduce-scatter".
  nbytes: int  # of its result, as count_collectives counts them.
  asynchronous: bool  # a start and a done that other work may run between.
  starts_before_last_matmul: bool  # starts before the last matrix multiply.
  flops_between: int  # of the matrix multiplies between its start and done.

  @property
  def overlapped(self) -> bool:
    """Asynchronous and started before the last matrix multiply."""
    return self.asynchronous and self.starts_before_last_matmul


class ReductionOverlap(NamedTuple):
  """How much of a program's gradient reduction overlaps its last matmuls.

  Attributes:
    overlapped_share: ``overlapped_bytes / total_bytes`` (0.0 without any
      gradient reduction).
    num_reductions: how many gradient-sized reductions the entry
      computation has.
    overlapped_bytes: the bytes of those that are asynchronous and start
      before the program's last matrix multiply.
    total_bytes: the bytes of all of them.
    reductions: each of them, in the order they start.
    last_matmul_in_loop: whether the program's last matrix multiply is in a
      loop (a ``while``): a micro-batch loop that keeps the last micro-batch,
      or a model's scanned layers.
  """

  overlapped_share: float
  num_reductions: int
  overlapped_bytes: int
  total_bytes: int
  reductions: tuple[ScheduledReduction, ...]
  last_matmul_in_loop: bool = False

  @property
  def why_not_hidden(self) -> tuple[str, ...]:
    """Why the bytes not overlapped are not, one line per cause (empty
    where all are): synchronous reductions, and asynchronous ones that
    start after the last matrix multiply, behind a loop or not."""
    late = [r for r in self.reductions if not r.overlapped]
    sync = [r for r in late if not r.asynchronous]
    after = [r for r in late if r.asynchronous]
    why = []
    if sync:
      why.append(
          f"{_share(sync, self.total_bytes)} in {len(sync)} synchronous"
          " reductions: the compiler runs them alone (on TPUs, asynchronous"
          " all-reduces need LIBTPU_INIT_ARGS flags: docs/performance.md).")
    if after and self.last_matmul_in_loop:
      why.append(
          f"{_share(after, self.total_bytes)} in {len(after)} reductions"
          " that start after the last matrix multiply, which is in a loop:"
          " a sum that loop produces is final only when it ends (the"
          " micro-batch loop keeping its last micro-batch, as"
          " overlap_reduction=False does, or a model's scanned layers,"
          " whose stacked leaves' gradients the backward loop finishes"
          " together).")
    elif after:
      why.append(
          f"{_share(after, self.total_bytes)} in {len(after)} reductions"
          " that start after the last matrix multiply: gradients the"
          " backward finishes last (commonly the token embedding's"
          " scatter-add and the output projection's weight gradient, which"
          " XLA may schedule last).")
    return tuple(why)

  def __str__(self) -> str:
    if not self.num_reductions:
      return "no gradient-sized reduction outside loops"
    asynchronous = sum(r.asynchronous for r in self.reductions)
    flops = sum(r.flops_between for r in self.reductions)
    return "\n  not hidden: ".join((
        f"{self.overlapped_share:.1%} of {self.total_bytes / 2**20:.2f} MiB"
        f" of gradient reduction overlapped: {self.num_reductions} reductions,"
        f" {asynchronous} asynchronous,"
        f" {sum(r.overlapped for r in self.reductions)} of those started"
        f" before the last matrix multiply, {flops / 1e9:.3g} GFLOP between"
        " their starts and dones", *self.why_not_hidden))


def _share(reductions, total: int) -> str:
  nbytes = sum(r.nbytes for r in reductions)
  return f"{nbytes / total:.1%} of the bytes ({nbytes / 2**20:.2f} MiB)"


class _Collective(NamedTuple):
  """The collective a reduction runs, read as ``hlo_text`` reads it."""

  name: str  # "all-reduce" or "reduce-scatter".
  rest: str  # its text from the opcode on: device groups, operands.
  shape_line: str  # the line whose result is its result.
  computation: str  # the computation it is an instruction of.


class _Event(NamedTuple):
  """An entry instruction that starts, continues or ends a reduction."""

  role: str  # "sync", "start", "update" or "done".
  key: str  # what pairs a start with its done.
  collective: _Collective | None  # on "sync" and "start".


def _collective(opcode: str, rest: str, line: str, computation: str,
                computations: dict[str, Any]) -> _Collective | None:
  """The reduction that an instruction runs itself, or None."""
  # XLA TPU's reduce-scatter fusion (a reduce-scatter itself may name the
  # same emitter in its backend config).
  if opcode == "fusion" and hlo_text.is_reduce_scatter_fusion(line):
    callee = _CALLS.search(rest)
    inner = _reduction_in(callee.group(1) if callee else "", computations)
    return None if inner is None else inner._replace(
        name="reduce-scatter", shape_line=line)
  name = hlo_text.OPCODE_TO_COLLECTIVE.get(opcode)
  return _Collective(name, rest, line, computation) if (
      name in _REDUCTIONS) else None


def _reduction_in(callee: str, computations: dict[str, Any]):
  """The first reduction that computation ``callee`` runs, or None."""
  for opcode, rest, line in computations.get(callee, ()):
    if found := _collective(opcode, rest, line, callee, computations):
      return found
  return None


def _event(opcode: str, rest: str, line: str, entry: str,
           computations: dict[str, Any]) -> _Event | None:
  """What the entry instruction does to a reduction, if anything."""
  name = hlo_text.instruction_name(line)
  operands = hlo_text.OPERANDS.match(rest)
  first = (operands.group(1).split(",")[0].split()[-1].lstrip("%")
           if operands and operands.group(1).strip() else "")
  if found := _collective(opcode, rest, line, entry, computations):
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


def _spans(entry: str, computations: dict[str, Any]):
  """Each reduction of ``entry``: [start event, start index, done index]."""
  open_at, key_of, spans = {}, {}, []
  instructions = computations[entry]
  for i, (opcode, rest, line) in enumerate(instructions):
    event = _event(opcode, rest, line, entry, computations)
    if event is None:
      continue
    key = key_of.get(event.key, event.key)
    if event.role == "sync":
      spans.append([event, i, i])
    elif event.role == "start":
      spans.append([event, i, len(instructions)])
      open_at[key] = spans[-1]
    elif event.role == "update":
      key_of[hlo_text.instruction_name(line)] = key
    elif key in open_at:
      open_at.pop(key)[2] = i
  return spans


def _reduction(span, entry_work, last_matmul, computations, positions, mesh,
               data_axes) -> ScheduledReduction | None:
  """The reduction of one span, or None if it is not gradient-sized or not
  over ``data_axes``."""
  (role, _, found), start, done = span
  shapes = hlo_text.result_shapes(found.shape_line)
  if hlo_text.is_scalar_sum(found.rest, shapes, found.computation,
                            computations):
    return None
  if mesh is not None and data_axes is not None and not set(
      hlo_text.collective_axes(found.rest, positions, mesh)) & set(data_axes):
    return None
  return ScheduledReduction(
      hlo_text.instruction_name(entry_work[start].line), found.name,
      sum(hlo_text.ITEMSIZE[t] * math.prod(d) for t, d in shapes),
      role == "start", start < last_matmul,
      sum(w.flops for w in entry_work[start + 1:done]))


class _Work(NamedTuple):
  line: str
  flops: int
  matmuls: int


def reduction_overlap(
    program: Any,
    *,
    data_axes: str | tuple[str, ...] | None = None,
    mesh: Any = None,
    min_bytes: int = 64,
) -> ReductionOverlap:
  """Reports how much of a step's gradient reduction overlaps its backward.

  A data-parallel step reduces its gradient once; that reduction is hidden
  only if it runs beside compute: asynchronously (a start, then the done,
  other instructions between), started before the program's last matrix
  multiply, as XLA's latency-hiding scheduler does where each leaf's
  gradient is final before the last backward ends. This reads the order
  that XLA scheduled (``compiled.as_text()``): each gradient-sized
  all-reduce and reduce-scatter of the entry computation (those inside loops
  are left out), whether it is asynchronous, whether it starts before the
  last matrix multiply (a ``dot`` or ``convolution``, in a fusion too, a
  cuBLAS or cuDNN custom-call, or a loop or branch holding one), and the
  flops of the matrix multiplies between its start and its done. A
  synchronous reduction is never overlapped. On TPUs, asynchronous
  all-reduces need ``LIBTPU_INIT_ARGS`` flags (docs/performance.md).

  Args:
    program: what :func:`optax_accum.count_collectives` takes: a compiled
      program, lowered (compiled here) or its HLO text
      (``compiled.as_text()``, scheduled).
    data_axes: the mesh axes the batch is split over: only the reductions
      over some of them count (not a tensor-parallel all-reduce); None
      counts every reduction.
    mesh: the mesh the program was compiled for; by default that of a
      compiled program's arguments. Needed with ``data_axes``.
    min_bytes: reductions of fewer bytes are left out, besides those of
      scalars (a loss, a token count), which always are.

  Returns:
    A :class:`ReductionOverlap`: ``overlapped_share`` (the overlapped bytes
    over all), ``num_reductions``, each :class:`ScheduledReduction`, and
    ``why_not_hidden``, a line per cause of the bytes not overlapped
    (printed with the report).

  Examples:
    >>> import optax_accum as oa
    >>> hlo = '''HloModule m, is_scheduled=true
    ... ENTRY %main (w: f32[64,64], x: f32[8,64]) -> f32[64,64] {
    ...   %w = f32[64,64] parameter(0)
    ...   %x = f32[8,64] parameter(1)
    ...   %dot.1 = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
    ...   %ar = f32[64,64] all-reduce-start(%w), replica_groups={}
    ...   %dot.2 = f32[8,64] dot(%dot.1, %w), lhs_contracting_dims={1}
    ...   ROOT %done = f32[64,64] all-reduce-done(%ar)
    ... }'''
    >>> report = oa.reduction_overlap(hlo)
    >>> report.overlapped_share, report.reductions[0].flops_between
    (1.0, 65536)
  """
  if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or (
      min_bytes < 0):
    raise ValueError(
        f"min_bytes must be a non-negative int, got {min_bytes!r}.")
  validation.check_mesh(mesh)
  program = step_reading.compiled(program)
  mesh = step_reading.program_mesh(program) if mesh is None else mesh
  data_axes = step_reading.check_data_axes(data_axes, mesh)
  try:
    text, devices = hlo.read_program(program)
  except TypeError as e:
    e.add_note("oa.reduction_overlap: that is its argument `program`.")
    raise
  if _MODULE.search(text) and not _SCHEDULED.search(text):
    raise ValueError(
        "program's HLO is not scheduled (no is_scheduled=true): pass the"
        " compiled program or its compiled.as_text(), whose order is the"
        " order XLA runs it in.")
  entry_name, computations = hlo_text.parse(text)
  flops = matmul_flops.Counter(computations)
  entry_work = [_Work(line, *flops.of_instruction(opcode, rest, line,
                                                  entry_name))
                for opcode, rest, line in computations[entry_name]]
  last_matmul = max((i for i, w in enumerate(entry_work) if w.matmuls),
                    default=-1)
  in_loop = last_matmul >= 0 and computations[entry_name][last_matmul][
      0] == "while"
  positions = None if mesh is None else hlo.logical_to_mesh_position(
      devices, mesh)
  found = [r for span in _spans(entry_name, computations)
           if (r := _reduction(span, entry_work, last_matmul, computations,
                               positions, mesh, data_axes)) is not None
           and r.nbytes >= min_bytes]
  total = sum(r.nbytes for r in found)
  overlapped = sum(r.nbytes for r in found if r.overlapped)
  return ReductionOverlap(overlapped / total if total else 0.0, len(found),
                          overlapped, total, tuple(found), in_loop)
