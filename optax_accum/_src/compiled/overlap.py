"""How much of a step's gradient reduction overlaps its last backward.

:func:`reduction_overlap` reads the scheduled HLO of a compiled program
(``compiled.as_text()``, ``is_scheduled=true``: each computation's
instructions in the order they run) on ``hlo_text``'s parser. Where each
gradient-sized all-reduce and reduce-scatter of the entry computation
starts and where it is done, in each of the forms XLA prints, is
``reduction_spans``'; those in the bodies of a model's own loops (its
layers scanned by ``oa.scan_layers``) are ``model_loops``'. The matrix
multiplies and their flops are ``matmul_flops``'.
"""

import math
import re
from typing import Any, NamedTuple

from optax_accum._src import validation
from optax_accum._src.compiled import hlo
from optax_accum._src.compiled import hlo_text
from optax_accum._src.compiled import matmul_flops
from optax_accum._src.compiled import model_loops
from optax_accum._src.compiled import reduction_spans
from optax_accum._src.compiled import step_reading

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
  # The bytes that other work between its start and done writes, matrix
  # multiplies aside (elementwise work: in a train step, commonly the
  # optimizer's update of leaves already reduced).
  bytes_written_between: int = 0

  @property
  def overlapped(self) -> bool:
    """Asynchronous and started before the last matrix multiply."""
    return self.asynchronous and self.starts_before_last_matmul


class ReductionOverlap(NamedTuple):
  """How much of a program's gradient reduction overlaps its last matmuls.

  Attributes:
    overlapped_share: ``overlapped_bytes / total_bytes`` (0.0 without any
      gradient reduction).
    num_reductions: how many gradient-sized reductions run per step: those
      of the entry computation, and those inside a model's loops once per
      trip.
    overlapped_bytes: the bytes of those that are overlapped: of the entry
      computation's, those asynchronous and started before the program's
      last matrix multiply; inside a loop, those asynchronous with a
      matrix multiply of the loop's body between start and done.
    total_bytes: the bytes of all of them.
    reductions: those of the entry computation, in the order they start.
    last_matmul_in_loop: whether the program's last matrix multiply is in a
      loop (a ``while``): a micro-batch loop that keeps the last micro-batch,
      or a model's scanned layers.
    loop_reductions: those in the bodies of loops other than the
      micro-batch loop (a model's layers scanned by ``oa.scan_layers``,
      which reduces each layer's slice there), each with its loop's trips.
  """

  overlapped_share: float
  num_reductions: int
  overlapped_bytes: int
  total_bytes: int
  reductions: tuple[ScheduledReduction, ...]
  last_matmul_in_loop: bool = False
  loop_reductions: tuple[model_loops.LoopReduction, ...] = ()

  @property
  def why_not_hidden(self) -> tuple[str, ...]:
    """Why the bytes not overlapped are not, one line per cause (empty
    where all are): synchronous reductions, asynchronous ones inside a loop
    with nothing between start and done, and asynchronous ones that start
    after the last matrix multiply, behind a loop or not."""
    share = lambda nbytes: _share(nbytes, self.total_bytes)
    late = [r for r in self.reductions if not r.overlapped]
    after = [r for r in late if r.asynchronous]
    in_loops = self.loop_reductions
    sync = [(r.nbytes, 1) for r in late if not r.asynchronous] + [
        (r.total_bytes, r.trips) for r in in_loops if not r.asynchronous]
    why = []
    if sync:
      why.append(
          f"{share(sum(b for b, _ in sync))} in {sum(n for _, n in sync)}"
          " synchronous reductions: the compiler runs them alone (on TPUs,"
          " asynchronous all-reduces need LIBTPU_INIT_ARGS flags:"
          " docs/performance.md).")
    why.extend(model_loops.why_not_hidden(in_loops, share))
    late_bytes = f"{share(sum(r.nbytes for r in after))} in {len(after)}"
    if after and self.last_matmul_in_loop and not any(
        r.overlapped for r in in_loops):
      why.append(
          f"{late_bytes} reductions"
          " that start after the last matrix multiply, which is in a loop:"
          " a sum that loop produces is final only when it ends (the"
          " micro-batch loop keeping its last micro-batch, as"
          " overlap_reduction=False does, or a model's scanned layers,"
          " whose stacked leaves' gradients the backward loop finishes"
          " together). overlap_reduction=False is oa.value_and_grad's"
          " default because the last micro-batch after the loop compiles"
          " the forward and backward twice and can raise the peak: compile"
          " your step with overlap_reduction=True and read its share and"
          " peak before keeping it.")
    elif after and self.last_matmul_in_loop:
      why.append(
          f"{late_bytes} reductions that start after the last matrix"
          " multiply, which is in a loop that reduces gradients inside it:"
          " those it does not (commonly the token embedding's scatter-add"
          " and the output projection's weight gradient, finished outside"
          " it, or a stacked leaf scanned by lax.scan rather than"
          " oa.scan_layers, whose gradient the loop finishes whole).")
    elif after:
      why.append(
          f"{late_bytes} reductions"
          " that start after the last matrix multiply: gradients the"
          " backward finishes last (commonly the token embedding's"
          " scatter-add and the output projection's weight gradient, which"
          " XLA may schedule last).")
    beside = [r for r in after if r.bytes_written_between >= r.nbytes]
    if beside:
      why[-1] += (
          f" Of those, {len(beside)}"
          f" {'runs' if len(beside) == 1 else 'run'} beside other work that"
          " writes at least the bytes it reduces"
          f" ({sum(r.bytes_written_between for r in beside) / 2**20:.2f} MiB"
          " in all: in a train step, commonly the optimizer's update of"
          " leaves already reduced, where no gradient-norm clip waits for"
          " every reduction): hidden as far as that work lasts as long as"
          " the transfer, which this reading cannot time.")
    return tuple(why)

  def __str__(self) -> str:
    if not self.num_reductions:
      return "no gradient-sized reduction outside loops"
    in_loops = self.loop_reductions
    asynchronous = sum(r.asynchronous for r in self.reductions) + sum(
        r.trips for r in in_loops if r.asynchronous)
    flops = sum(r.flops_between for r in self.reductions) + sum(
        r.flops_between * r.trips for r in in_loops)
    lines = [
        f"{self.overlapped_share:.1%} of {self.total_bytes / 2**20:.2f} MiB"
        f" of gradient reduction overlapped: {self.num_reductions} reductions,"
        f" {asynchronous} asynchronous,"
        f" {sum(r.overlapped for r in self.reductions)} of those"
        f"{' outside loops' if in_loops else ''} started before the last"
        f" matrix multiply, {flops / 1e9:.3g} GFLOP between their starts"
        " and dones"]
    if in_loops:
      lines.append(model_loops.summary(in_loops))
    return "\n  ".join(lines) + "".join(
        f"\n  not hidden: {why}" for why in self.why_not_hidden)


def _share(nbytes: int, total: int) -> str:
  return f"{nbytes / total:.1%} of the bytes ({nbytes / 2**20:.2f} MiB)"


def _reduction(span: reduction_spans.Span, entry_work, last_matmul,
               computations, positions, mesh,
               data_axes) -> ScheduledReduction | None:
  """The reduction of one span of the entry computation, or None if it is
  not gradient-sized or not over ``data_axes``."""
  nbytes = reduction_spans.gradient_bytes(span, computations, positions, mesh,
                                          data_axes)
  if nbytes is None:
    return None
  between = entry_work[span.start + 1:span.done]
  return ScheduledReduction(
      span.name, span.collective.name, nbytes, span.asynchronous,
      span.start < last_matmul, sum(w.flops for w in between),
      sum(w.written for w in between if not w.matmuls))


# Instructions that move or name data without computing: no work to hide a
# transfer behind.
# (Every ``-start`` and ``-done`` too: ``_written`` reads the suffix.)
_NO_WORK = frozenset(hlo_text.COLLECTIVES) | {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "async-update", "send", "recv", "opt-barrier", "after-all",
    "partition-id", "replica-id"}


class _Work(NamedTuple):
  line: str
  flops: int
  matmuls: int
  written: int  # the bytes of its result where it computes, else 0.


def _written(opcode: str, line: str) -> int:
  if opcode in _NO_WORK or opcode.endswith(("-start", "-done")) or (
      hlo_text.is_reduce_scatter_fusion(line)):
    return 0
  return sum(hlo_text.ITEMSIZE[dtype] * math.prod(dims)
             for dtype, dims in hlo_text.result_shapes(line))


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
  all-reduce and reduce-scatter of the entry computation, whether it is
  asynchronous, whether it starts before the last matrix multiply (a
  ``dot`` or ``convolution``, in a fusion too, a cuBLAS or cuDNN
  custom-call, or a loop or branch holding one), the flops of the matrix
  multiplies between its start and its done, and the bytes that other work
  there writes (in a train step, the optimizer's update of leaves already
  reduced may run beside a reduction that starts after the backward). Those
  in the body of a model's own loop (:func:`optax_accum.scan_layers`
  reduces each layer's slice in its backward loop) run once per trip and
  are overlapped where asynchronous with a matrix multiply of that body
  between start and done; those in the micro-batch loop are left out. A
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
    over all), ``num_reductions``, each :class:`ScheduledReduction`, those
    inside loops (``loop_reductions``), and ``why_not_hidden``, a line per
    cause of the bytes not overlapped (printed with the report).

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
                                                  entry_name),
                      _written(opcode, line))
                for opcode, rest, line in computations[entry_name]]
  last_matmul = max((i for i, w in enumerate(entry_work) if w.matmuls),
                    default=-1)
  in_loop = last_matmul >= 0 and computations[entry_name][last_matmul][
      0] == "while"
  positions = None if mesh is None else hlo.logical_to_mesh_position(
      devices, mesh)
  found = [r for span in reduction_spans.spans(entry_name, computations)
           if (r := _reduction(span, entry_work, last_matmul, computations,
                               positions, mesh, data_axes)) is not None
           and r.nbytes >= min_bytes]
  inside = model_loops.read(entry_name, computations, flops, positions,
                                mesh, data_axes, min_bytes)
  total = sum(r.nbytes for r in found) + sum(r.total_bytes for r in inside)
  overlapped = sum(r.nbytes for r in found if r.overlapped) + sum(
      r.total_bytes for r in inside if r.overlapped)
  return ReductionOverlap(
      overlapped / total if total else 0.0,
      len(found) + sum(r.trips for r in inside), overlapped, total,
      tuple(found), in_loop, inside)
