"""Reading the HLO text of a compiled program: its collectives, and where.

A parser of the optimized HLO that XLA prints (``compiled.as_text()``): its
computations and their instructions, the while loops and conditionals that
call computations, the shapes of results, and the device groups of
collectives (listed replica groups, source-target pairs, XLA's iota lists,
Shardy's mesh axes), read as the mesh axes they span. :func:`parse_collectives`
walks it into one :class:`Collective` per collective instruction. It reads
text only; ``hlo`` reads compiled programs and counts what this finds.

Its public names are the parser the other readers of this folder walk
programs with: :func:`parse`, :func:`instruction_name`, :func:`result_shapes`,
:func:`collective_axes`, the patterns ``CALLED``, ``OPERANDS`` and ``SHAPE``,
and the tables ``OPCODE_TO_COLLECTIVE`` and ``ITEMSIZE``.
"""

import itertools
import math
import re
from typing import Any, NamedTuple

import numpy as np

from optax_accum._src import names
from optax_accum._src.compiled import async_chains

COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "all-to-all",
)

# Asynchronous forms count once, at their start; "-done" only waits for it.
OPCODE_TO_COLLECTIVE = {op: op for op in COLLECTIVES}
OPCODE_TO_COLLECTIVE.update({f"{op}-start": op for op in COLLECTIVES})
OPCODE_TO_COLLECTIVE["ragged-all-to-all"] = "all-to-all"

ASYNC_CONTINUATIONS = ("async-update", "async-done")

_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[^\s=]+\s*=\s*(.*)$")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
# XLA's TPU compiler writes a reduce-scatter as a fusion whose emitter is
# this (backend_config; "SingleInputAllReduceScatterFusion" where it pads the
# operand first), calling a computation of an all-reduce and the
# dynamic-slice of each device's part: one reduce-scatter, of the fusion's
# result (a ring's reduce-scatter, not an all-reduce; libtpu 0.0.42).
_REDUCE_SCATTER_FUSION = re.compile(r'"emitter":"\w*AllReduceScatterFusion"')
_NAME = re.compile(r"^\s+(?:ROOT\s+)?%?([^\s=]+)\s*=")
OPERANDS = re.compile(r"^[a-z][a-z0-9\-]*\(([^()]*)\)")
CALLED = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations|true_computation"
    r"|false_computation)=(\{[^}]*\}|%?[^\s,)]+)"
)
# The spellings of a collective's device groups in HLO text: listed groups
# ({{0,1},{2,3}}; {} is every device), XLA's iota list ([2,4]<=[8],
# [4,2]<=[2,4]T(1,0)), and Shardy's mesh axes (mesh['x'=2,'y'=4] {'y'}).
_INT_GROUPS = r"\{((?:\{[\d,\s]*\},?\s*)*)\}"
_LISTED_GROUPS = re.compile(r"replica_groups=" + _INT_GROUPS)
_SOURCE_TARGET_PAIRS = re.compile(r"source_target_pairs=" + _INT_GROUPS)
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")
_LOOP_ATTRIBUTES = ("condition", "body")
_BRANCH_ATTRIBUTES = (
    "branch_computations",
    "true_computation",
    "false_computation",
)
# A while named AT_MOST_ONCE_SCOPE (conditional_loops.run_if's) runs once or
# not at all: a branch.
_AT_MOST_ONCE = re.compile(
    r'\bop_name="[^"]*' + re.escape(names.AT_MOST_ONCE_SCOPE) + r'/while"')
# oa.value_and_grad's token counts, summed over the devices before its loop
# (XLA makes the k of them one small all-reduce): read as scalars.
_TOKEN_COUNTS = re.compile(
    r'\bop_name="[^"]*' + re.escape(names.TOKEN_COUNTS_SCOPE) + "/")


def enclosure(opcode: str, rest: str, attribute: str) -> str | None:
  """What calling a computation by ``attribute`` puts it in: "loop",
  "branch" (a conditional's branch, or the body of a loop run at most once,
  ``conditional_loops.run_if``'s) or None."""
  if attribute in _BRANCH_ATTRIBUTES:
    return "branch"
  if attribute in _LOOP_ATTRIBUTES:
    once = opcode == "while" and runs_at_most_once(rest)
    return "branch" if once else "loop"
  return None


def runs_at_most_once(rest: str) -> bool:
  """Whether a while instruction (its text from the opcode on) is
  ``conditional_loops.run_if``'s."""
  return _AT_MOST_ONCE.search(rest) is not None

# The parts of a result's shape (dtype[dims]), and the bytes of each dtype.
SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64"
                    r"|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
             "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


class Collective(NamedTuple):
  """One collective instruction of a compiled program, and where it runs."""

  collective: str  # "all-reduce", "reduce-scatter", ...
  looped: bool  # inside a while loop.
  branched: bool  # inside a branch of a conditional.
  axes: tuple[str, ...] | None  # the mesh axes it spans (None: no mesh).
  nbytes: int  # the bytes of its result (all of a tuple's parts).
  # Whether it reduces scalars only: every part of its result is a scalar,
  # or its operand is XLA's concatenation of scalars (its GPU combiner's).
  scalar: bool


def is_reduce_scatter_fusion(line: str) -> bool:
  """Whether the instruction ``line`` is XLA TPU's fused reduce-scatter."""
  return _REDUCE_SCATTER_FUSION.search(line) is not None


def ints(text: str | None) -> list[int]:
  """The integers of a comma-separated list (``"2,4"``); [] for none."""
  return [int(i) for i in text.split(",") if i.strip()] if text else []


def _iota(dims: list[int], perm: list[int]) -> np.ndarray:
  """XLA's iota device list: 0, 1, ... shaped ``dims``, permuted by ``perm``."""
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _listed(text: str) -> list[list[int]]:
  return [ints(group) for group in re.findall(r"\{([^}]*)\}", text)]


def _mesh_axes_groups(match: re.Match[str]) -> list[list[int]]:
  """Shardy's ``mesh[...] {axes}`` device groups, as lists of device ids.

  A group axis ``'x':(p)s`` is a sub-axis: axis ``x`` viewed as major to minor
  dimensions ``[p, s, rest]``, grouping over the middle one.
  """
  mesh_text, device_ids, group_text = match.groups()
  sizes = {name: int(size) for name, size in _MESH_AXIS.findall(mesh_text)}
  cuts = {name: {1, size} for name, size in sizes.items()}
  grouped = []  # (axis name, pre-size, size) of each group axis.
  for name, pre, size in _GROUP_AXIS.findall(group_text):
    pre, size = (int(pre), int(size)) if size else (1, sizes[name])
    cuts[name] |= {pre, pre * size}
    grouped.append((name, pre))
  dims, grouped_dims = [], []
  for name in sizes:  # each axis split at its sub-axes' boundaries.
    bounds = sorted(cuts[name])
    for low, high in itertools.pairwise(bounds):
      if (name, low) in grouped:
        grouped_dims.append(len(dims))
      dims.append(high // low)
  if device_ids and device_ids.startswith("["):  # [dims]T(perm), or iota.
    iota = re.fullmatch(
        r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", device_ids)
    if iota is None:
      raise ValueError(f"Cannot read the mesh's device_ids=({device_ids}).")
    shape, reshape, perm = (ints(group) for group in iota.groups())
    ids = _iota(reshape or shape, perm)
  else:
    ids = np.array(ints(device_ids) or range(math.prod(sizes.values())))
  kept = [d for d in range(len(dims)) if d not in grouped_dims]
  group_size = math.prod(dims[d] for d in grouped_dims)
  ids = ids.reshape(dims).transpose(kept + grouped_dims)
  return ids.reshape(-1, group_size).tolist()


def _device_groups(
    attributes: str, num_devices: int
) -> list[list[int]] | None:
  """The logical device ids each group of a collective combines, or None.

  Logical ids are positions in the program's device assignment (partition
  ids under ``jit``, replica ids under ``pmap``). A collective-permute's
  source-target pairs count as groups of two.
  """
  if match := _LISTED_GROUPS.search(attributes):
    return _listed(match.group(1)) or [list(range(num_devices))]
  if match := _SOURCE_TARGET_PAIRS.search(attributes):
    return _listed(match.group(1))
  if match := _IOTA_GROUPS.search(attributes):
    shape, dims, perm = (ints(group) for group in match.groups())
    return _iota(dims, perm).reshape(shape).tolist()
  if match := _MESH_GROUPS.search(attributes):
    return _mesh_axes_groups(match)
  if "replica_groups=" in attributes or "source_target_pairs=" in attributes:
    return None
  return [list(range(num_devices))]  # no groups given: every device.


def _axes_spanned(
    groups: list[list[int]], positions: np.ndarray, mesh: Any
) -> tuple[str, ...]:
  """The mesh axes along which the devices of some group differ, in order."""
  varies = np.zeros(len(mesh.axis_sizes), bool)
  for group in groups:
    if max(group, default=0) >= len(positions):
      raise ValueError(
          f"A collective combines devices {group}, but mesh has only"
          f" {len(positions)} devices: pass the mesh the program was compiled"
          " for."
      )
    coords = np.stack(np.unravel_index(positions[group], mesh.axis_sizes))
    varies |= (coords != coords[:, :1]).any(axis=1)
  return tuple(name for name, v in zip(mesh.axis_names, varies) if v)


def _operation(line: str) -> tuple[str, str] | None:
  """The opcode of an HLO instruction line and the text after it."""
  match = _INSTRUCTION.match(line)
  if match is None:
    return None
  rest = match.group(1)
  if rest.startswith("("):  # a tuple-shaped result: skip the whole shape.
    depth = 0
    for i, char in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(char, 0)
      if depth == 0:
        rest = rest[i + 1:].lstrip()
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else ""
  opcode = _OPCODE.match(rest)
  return (opcode.group(1), rest) if opcode else None


def parse(text: str) -> tuple[str, dict[str, list[tuple[str, str, str]]]]:
  """The entry computation's name and every computation's instructions."""
  computations = {}
  entry = None
  current = None
  for line in text.splitlines():
    header = _COMPUTATION_HEADER.match(line)
    if header is not None:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is not None:
      operation = _operation(line)
      if operation is not None:
        computations[current].append(operation + (line,))
  if entry is None:
    if "stablehlo." in text or "func.func" in text:
      raise ValueError(
          "Got StableHLO (lowered.as_text()); count_collectives needs the"
          " compiled HLO, e.g. jax.jit(f).lower(*args).compile()."
      )
    raise ValueError("The text has no ENTRY computation: it is not HLO.")
  return entry, computations


def result_shapes(line: str) -> list[tuple[str, list[int]]]:
  """``(dtype, dims)`` of each part of an instruction's result."""
  head = _INSTRUCTION.match(line).group(1)
  opcode_at = head.find(_operation(line)[0] + "(")
  return [(dtype, ints(dims)) for dtype, dims in
          SHAPE.findall(head[:opcode_at])]


def instruction_name(line: str) -> str:
  """The name an HLO instruction line defines (``%fusion.3``: ``fusion.3``)."""
  return _NAME.match(line).group(1)


def _elements(line: str) -> int:
  return sum(math.prod(d) for _, d in result_shapes(line))


def is_scalar_sum(rest: str, shapes: list[Any], computation: str,
                  computations: dict[str, Any]) -> bool:
  """Whether a collective sums scalars, not a gradient: its results are
  scalars, or XLA's concatenation of them, or the loop's token counts."""
  return (all(not d for _, d in shapes)
          or bool(_TOKEN_COUNTS.search(rest))
          or _concatenates_scalars(rest, computation, computations))


def _concatenates_scalars(rest: str, computation: str,
                          computations: dict[str, Any]) -> bool:
  """Whether a collective's one operand is XLA's concatenation of scalars.

  XLA's GPU combiner concatenates the scalars that several all-reduces sum
  (a loss, a token count) into one small array, a ``concatenate`` or a
  fusion whose root is one, each of its parts a scalar or one element.
  """
  operands = OPERANDS.match(rest)
  operand_names = operands.group(1).split(",") if operands else []
  if len(operand_names) != 1:
    return False
  lines = {instruction_name(line): (op, r, line)
           for op, r, line in computations.get(computation, ())}
  found = lines.get(operand_names[0].split()[-1].lstrip("%"))
  if found is None:
    return False
  opcode, rest, _ = found
  if opcode == "concatenate":
    parts = OPERANDS.match(rest).group(1).split(",")
    return all(
        (part := lines.get(name.split()[-1].lstrip("%"))) is not None
        and _elements(part[2]) <= 1 for name in parts)
  called = re.search(r"\bcalls=%?([^\s,)]+)", rest)
  if opcode != "fusion" or called is None:
    return False
  fused = computations.get(called.group(1), ())
  roots = [op for op, _, line in fused if line.lstrip().startswith("ROOT")]
  params = [line for op, _, line in fused if op == "parameter"]
  return (roots == ["concatenate"] and bool(params)
          and all(_elements(line) <= 1 for line in params))


def parse_collectives(text: str, positions: Any = None,
                mesh: Any = None) -> list[Collective]:
  """Every collective of the HLO ``text``, walking loops and branches.

  ``positions`` (each logical device id's flat index in ``mesh``) and
  ``mesh`` give each collective the mesh axes it spans; without them its
  ``axes`` are None.
  """
  entry, computations = parse(text)
  found = []

  def visit(name, looped, branched, path, scatter=None):
    if name in path:  # not expected in HLO; guards against a malformed text.
      return
    for opcode, rest, line in computations.get(name, ()):
      collective = OPCODE_TO_COLLECTIVE.get(opcode)
      if collective is not None and not async_chains.is_chain_copy(
          rest, name, computations):
        axes = None if positions is None else collective_axes(
            rest, positions, mesh)
        shapes = result_shapes(line if scatter is None else scatter)
        if scatter is not None and collective == "all-reduce":
          collective = "reduce-scatter"  # XLA's TPU reduce-scatter fusion.
        found.append(Collective(
            collective, looped, branched, axes,
            sum(ITEMSIZE[t] * math.prod(d) for t, d in shapes),
            is_scalar_sum(rest, shapes, name, computations)))
      if opcode in ASYNC_CONTINUATIONS:  # the same computation as its start.
        continue
      fused_scatter = line if is_reduce_scatter_fusion(line) else None
      for attribute, called in CALLED.findall(rest):
        for callee in called.strip("{}").split(","):
          callee = callee.strip().lstrip("%")
          if callee:
            place = enclosure(opcode, rest, attribute)
            visit(
                callee,
                looped or place == "loop",
                branched or place == "branch",
                path | {name},
                fused_scatter if attribute == "calls" else scatter,
            )

  visit(entry, False, False, frozenset())
  return found


def collective_axes(
    attributes: str, positions: np.ndarray, mesh: Any
) -> tuple[str, ...]:
  """The mesh axes a collective's device groups span, read from its text."""
  groups = _device_groups(attributes, len(positions))
  if groups is None:
    text = attributes if len(attributes) < 200 else attributes[:200] + "..."
    raise ValueError(
        f"Cannot read the device groups of the collective `{text}`: please"
        " report it, with the jax version."
    )
  return _axes_spanned(groups, positions, mesh)
