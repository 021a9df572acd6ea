"""The matrix multiplies of compiled HLO, and their flops.

A matrix multiply is a ``dot``, a ``convolution`` (XLA's TPU compiler
writes dots as convolutions) or a GPU library call (a cuBLAS GEMM, a cuDNN
convolution custom-call). An instruction holds those of the computations
it calls: a fusion's (where XLA's TPU compiler fuses the weight-gradient
convolution with the accumulation add, or with an asynchronous
collective's next steps), a loop's body times its trip count, the largest
of a conditional's branches. ``overlap`` reads them off the entry
computation, in the order they run.
"""

import math
import re
from typing import Any

from optax_accum._src.compiled import hlo_text
from optax_accum._src.compiled import step_reading

_LHS_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
# A GEMM custom-call's dimension numbers, in its backend config.
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_DIM_LABELS = re.compile(r"\bdim_labels=[^_\s]+_([^-\s]+)->")
_COMMENT = re.compile(r"/\*.*?\*/")  # XLA's /*index=5*/ in operand lists.
_LIBRARY_MATMUL = re.compile(
    r'custom_call_target="(__cublas\$[^"]*|__cudnn\$conv[^"]*)"')


class Counter:
  """The flops and matrix multiplies of instructions, computation by
  computation (each computation's counted once)."""

  def __init__(self, computations: dict[str, Any]):
    self._computations = computations
    self._totals = {}
    self._lines = {}

  def of_computation(self, name: str) -> tuple[int, int]:
    """``(flops, matrix multiplies)`` of one run of computation ``name``."""
    if name not in self._totals:
      self._totals[name] = (0, 0)  # a guard: HLO does not recurse.
      parts = [self.of_instruction(opcode, rest, line, name)
               for opcode, rest, line in self._computations.get(name, ())]
      self._totals[name] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    return self._totals[name]

  def of_instruction(self, opcode: str, rest: str, line: str,
                     computation: str) -> tuple[int, int]:
    """``(flops, matrix multiplies)`` of an instruction of ``computation``,
    with those of the computations it calls."""
    flops = self._own_flops(opcode, rest, line, computation)
    totals = [flops or 0, int(flops is not None)]
    if opcode in hlo_text.ASYNC_CONTINUATIONS:  # the start's computation.
      return tuple(totals)
    branches = []
    for attribute, called in hlo_text.CALLED.findall(rest):
      for callee in called.strip("{}").split(","):
        callee = callee.strip().lstrip("%")
        if not callee:
          continue
        inner = self.of_computation(callee)
        place = hlo_text.enclosure(opcode, rest, attribute)
        if place == "branch":
          branches.append(inner)
          continue
        trips = 1
        if place == "loop":
          trips = step_reading.trip_count(rest, self._computations) or 1
        totals = [totals[0] + trips * inner[0], totals[1] + trips * inner[1]]
    if branches:
      most = max(branches)
      totals = [totals[0] + most[0], totals[1] + most[1]]
    return tuple(totals)

  def _own_flops(self, opcode: str, rest: str, line: str,
                 computation: str) -> int | None:
    """The flops of the instruction itself if it multiplies matrices (0
    where the shapes are not told), else None."""
    library = opcode == "custom-call" and _LIBRARY_MATMUL.search(rest)
    if opcode not in ("dot", "convolution") and not library:
      return None
    shapes = hlo_text.result_shapes(line)
    operands = self._operand_dims(rest, computation)
    if not shapes or len(operands) < 2:
      return 0
    out = math.prod(shapes[0][1])
    contracting = (_LHS_CONTRACTING.search(rest)
                   or _GEMM_CONTRACTING.search(rest))
    if contracting is not None:
      dims = hlo_text.ints(contracting.group(1).replace('"', ""))
      return 2 * out * math.prod(operands[0][d] for d in dims
                                 if d < len(operands[0]))
    labels = _DIM_LABELS.search(rest)
    if labels is None or "o" not in labels.group(1):
      return 0
    kernel = operands[1]
    o = labels.group(1).index("o")
    if o >= len(kernel) or not kernel[o]:
      return 0
    # Each output element sums over the kernel's window and input features.
    return 2 * out * math.prod(kernel) // kernel[o]

  def _operand_dims(self, rest: str, computation: str) -> list[list[int]]:
    """The dimensions of an instruction's operands, where it names them."""
    if computation not in self._lines:
      self._lines[computation] = {
          hlo_text.instruction_name(line): line
          for _, _, line in self._computations.get(computation, ())}
    lines = self._lines[computation]
    operands = hlo_text.OPERANDS.match(rest)
    dims = []
    listed = _COMMENT.sub("", operands.group(1)) if operands else ""
    for operand in listed.split(","):
      operand = operand.strip()
      found = lines.get(operand.split()[-1].lstrip("%")) if operand else None
      shapes = (hlo_text.result_shapes(found) if found is not None
                else [(t, hlo_text.ints(d))
                      for t, d in hlo_text.SHAPE.findall(operand)])
      if shapes:
        dims.append(shapes[0][1])
    return dims
