"""What produces each float32 running sum in a compiled micro-batch loop.

Read from the loop body's HLO text: the weight-gradient matrix multiply with
the add fused in (XLA TPU: an ``add`` at the root of the convolution fusion;
XLA GPU: an ``add`` at the root of a Triton gemm fusion, or a cuBLAS gemm
with ``beta`` = 1), or a separate elementwise pass over the gradient. Fused,
a micro-step touches 8 B per parameter (the sum read and written); apart,
12 B (the float32 gradient read besides).
"""

import math
import re

from optax_accum._src.compiled import hlo_text

_BODY = re.compile(r"\bbody=%?([^\s,)]+)")
_CALLS = re.compile(r"\bcalls=%?([^\s,)]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BETA = re.compile(r'"beta":\s*([0-9.eE+-]+)')
_MATMULS = ("convolution", "dot")
# Followed to their operand: XLA TPU moves a sum between memories with an
# asynchronous copy (copy-start, copy-done).
_PASS = ("bitcast", "get-tuple-element", "copy", "copy-start", "copy-done")
_MIN_SUM_BYTES = 4096  # smaller carries are counters and scalar sums.


def _instructions(computation):
  return {hlo_text.instruction_name(line): (opcode, rest, line)
          for opcode, rest, line in computation}


def _operands(rest):
  found = hlo_text.OPERANDS.match(rest)
  if not found or not found.group(1).strip():
    return []
  listed = re.sub(r"/\*.*?\*/", "", found.group(1))  # /*index=5*/
  return [part.split()[-1].lstrip("%")
          for part in listed.split(",") if part.strip()]


def _has(computations, name, opcodes, seen=None):
  """Whether computation ``name`` (or a fusion it calls) holds ``opcodes``."""
  seen = set() if seen is None else seen
  if name in seen:
    return False
  seen.add(name)
  for opcode, rest, _ in computations.get(name, ()):
    if opcode in opcodes:
      return True
    callee = _CALLS.search(rest)
    if opcode == "fusion" and callee and _has(computations, callee.group(1),
                                              opcodes, seen):
      return True
  return False


def _root_op(computations, name, index):
  """The opcode that computes output ``index`` of computation ``name``."""
  body = computations.get(name, ())
  if not body:
    return None
  table = _instructions(body)
  opcode, rest, line = next(
      (op for op in body if op[2].lstrip().startswith("ROOT")), body[-1])
  if opcode == "tuple" and index is not None:
    opcode, rest, line = table.get(_operands(rest)[index], (opcode, rest,
                                                            line))
  while opcode == "bitcast":
    opcode, rest, line = table.get(_operands(rest)[0], (None, "", ""))
  if opcode == "fusion":  # a nested fusion: its own root.
    callee = _CALLS.search(rest)
    return _root_op(computations, callee.group(1), None) if callee else None
  return opcode


def _producer(computations, body, name):
  """How the loop body computes carry element ``name``."""
  table = _instructions(computations[body])
  index, copied = None, False
  while name in table:
    opcode, rest, line = table[name]
    if opcode == "parameter":
      return "passed through"
    if opcode == "get-tuple-element":
      found = _INDEX.search(rest)
      operand = _operands(rest)[0]
      if table.get(operand, ("",))[0] == "parameter":
        return "passed through"
      index = int(found.group(1)) if found else None
      name = operand
      continue
    if opcode in _PASS:
      copied = copied or opcode == "copy"  # a copy-done moves, not adds.
      name = _operands(rest)[0]
      continue
    break
  else:
    return "unknown"
  suffix = " (then copied)" if copied else ""
  if opcode == "custom-call":
    target = _TARGET.search(rest)
    target = target.group(1) if target else "?"
    if "gemm" in target or "matmul" in target:
      beta = _BETA.search(line)
      fused = beta is not None and float(beta.group(1)) != 0.0
      return ("fused: gemm with beta=1" if fused else "gemm, add apart") + (
          suffix)
    return f"custom-call {target}{suffix}"
  if opcode == "fusion":
    callee = _CALLS.search(rest).group(1)
    matmul = _has(computations, callee, _MATMULS)
    root = _root_op(computations, callee, index)
    if matmul and root == "add":
      return "fused: add in the matmul's fusion" + suffix
    if matmul:
      return f"matmul fusion, root {root}" + suffix
    if root == "add" and _has(computations, callee, ("reduce",)):
      return "fused: add in the gradient's reduction" + suffix
    if _has(computations, callee, ("scatter",)):
      return "scatter-add into the sum" + suffix
    if root == "add" or _has(computations, callee, ("add",)):
      return "separate: elementwise add fusion" + suffix
    return f"fusion, root {root}" + suffix
  if opcode == "add":
    return "separate: add" + suffix
  return opcode + suffix


def accumulation_adds(text):
  """For the while loop with the most float32 running sums: what produces
  each (``[[shape, how], ...]``, in carry order) and their counts."""
  _, computations = hlo_text.parse(text)
  best = []
  for computation in computations.values():
    for opcode, rest, _ in computation:
      found = _BODY.search(rest)
      if opcode != "while" or not found or found.group(1) not in computations:
        continue
      body = found.group(1)
      table = _instructions(computations[body])
      root = next((op for op in computations[body]
                   if op[2].lstrip().startswith("ROOT")), None)
      if root is None or root[0] != "tuple":
        continue
      sums = []
      for operand in _operands(root[1]):
        if operand not in table:
          continue
        shapes = hlo_text.result_shapes(table[operand][2])
        if len(shapes) != 1 or shapes[0][0] != "f32":
          continue
        nbytes = 4 * math.prod(shapes[0][1])
        how = _producer(computations, body, operand)
        if nbytes >= _MIN_SUM_BYTES and how != "passed through":
          sums.append([f"f32{shapes[0][1]}", nbytes, how])
      if len(sums) > len(best):
        best = sums
  counts = {}
  for _, _, how in best:
    kind = how.split(":")[0] if ":" in how else (
        "scatter-add" if how.startswith("scatter") else "other")
    counts[kind] = counts.get(kind, 0) + 1
  # Per parameter and micro-step, over the sums a matmul's gradient feeds:
  # fused, the sum read and written (8 B); apart, the float32 gradient read
  # besides (12 B). A scatter-add (the embedding) touches only its rows.
  fused = sum(n for _, n, how in best if how.startswith("fused"))
  apart = sum(n for _, n, how in best if how.startswith("separate"))
  return {"sums": best, "counts": counts,
          "bytes_per_parameter": (8 * fused + 12 * apart) / (fused + apart)
                                 if fused + apart else None}
