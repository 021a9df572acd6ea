"""Counting the collectives of a compiled program, by where they run."""

import collections
import re
from typing import Any, NamedTuple

import jax

COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "collective-permute",
    "all-to-all",
)

# Asynchronous forms count once, at their start; "-done" only waits for it.
_OPCODE_TO_COLLECTIVE = {op: op for op in COLLECTIVES}
_OPCODE_TO_COLLECTIVE.update({f"{op}-start": op for op in COLLECTIVES})
_OPCODE_TO_COLLECTIVE["ragged-all-to-all"] = "all-to-all"

_ASYNC_CONTINUATIONS = ("async-update", "async-done")

_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[^\s=]+\s*=\s*(.*)$")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(
    r"\b(condition|body|to_apply|calls|branch_computations|true_computation"
    r"|false_computation)=(\{[^}]*\}|%?[^\s,)]+)"
)
_LOOP_ATTRIBUTES = ("condition", "body")
_BRANCH_ATTRIBUTES = (
    "branch_computations",
    "true_computation",
    "false_computation",
)


class CollectiveCounts(NamedTuple):
  """Collectives of a compiled program, by where they run.

  Each field maps a collective's name (``"all-reduce"``, ``"reduce-scatter"``,
  ``"all-gather"``, ``"collective-permute"``, ``"all-to-all"``) to how many
  times it appears in the program text; names that do not appear are left out.
  A collective inside a loop body runs once per iteration; one inside a
  branch of a conditional runs only when that branch is taken.

  Attributes:
    total: everywhere in the program.
    in_loop: inside a while loop (a scan, a fori_loop): once per iteration.
    in_branch: inside a branch of a conditional (``lax.cond``).
    outside: neither in a loop nor in a branch: once per call.
  """

  total: dict[str, int]  # everywhere in the program.
  in_loop: dict[str, int]  # inside a while loop (a scan, a fori_loop).
  in_branch: dict[str, int]  # inside a branch of a conditional (lax.cond).
  outside: dict[str, int]  # neither in a loop nor in a branch: once per call.


def _hlo_text(program: Any) -> str:
  """The optimized HLO text of a compiled or lowered program, or text as is."""
  if isinstance(program, str):
    return program
  if isinstance(program, jax.stages.Lowered):
    program = program.compile()
  if isinstance(program, jax.stages.Compiled):
    text = program.as_text()
    if isinstance(text, str):
      return text
  raise TypeError(
      "Expected a compiled program (jax.jit(f).lower(*args).compile()), a"
      " lowered one, or its HLO text, got"
      f" {type(program).__name__}."
  )


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


def _parse(text: str) -> tuple[str, dict[str, list[tuple[str, str]]]]:
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
        computations[current].append(operation)
  if entry is None:
    if "stablehlo." in text or "func.func" in text:
      raise ValueError(
          "Got StableHLO (lowered.as_text()); count_collectives needs the"
          " compiled HLO, e.g. jax.jit(f).lower(*args).compile()."
      )
    raise ValueError("The text has no ENTRY computation: it is not HLO.")
  return entry, computations


def count_collectives(program: Any) -> CollectiveCounts:
  """Counts the collectives of a compiled program, inside and outside loops.

  Accumulating gradients should communicate once per optimizer update, not
  once per micro-batch. This reads the program that XLA actually runs (after
  sharding propagation and optimization) and reports how many all-reduces,
  reduce-scatters, all-gathers, collective-permutes and all-to-alls it has,
  and where: inside a while loop (the body of a :func:`jax.lax.scan` runs once
  per micro-batch), inside a branch of a conditional (such as the emitting
  branch of :func:`optax_accum.accumulate`) or outside both. Counts are static:
  one per instruction in the program text, whatever the trip count.

  Args:
    program: a compiled program (``jax.jit(f).lower(*args).compile()``), a
      lowered one (it is compiled), or its HLO text (``compiled.as_text()``).

  Returns:
    A :class:`CollectiveCounts` of dicts mapping collective names to counts:
    ``total``, ``in_loop``, ``in_branch`` and ``outside``. A collective in a
    branch of a conditional inside a loop counts in both ``in_loop`` and
    ``in_branch``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((1,), ('data',))
    >>> def step(x):  # one all-reduce per loop iteration, then one after
    ...   total, _ = jax.lax.scan(
    ...       lambda c, xi: (c + jax.lax.psum(xi, 'data'), None), 0.0, x)
    ...   return jax.lax.psum(total, 'data')
    >>> f = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())
    >>> counts = oa.count_collectives(jax.jit(f).lower(jnp.ones(3)).compile())
    >>> counts.in_loop, counts.outside
    ({'all-reduce': 1}, {'all-reduce': 1})
  """
  entry, computations = _parse(_hlo_text(program))
  total = collections.Counter()
  in_loop = collections.Counter()
  in_branch = collections.Counter()
  outside = collections.Counter()

  def visit(name, looped, branched, path):
    if name in path:  # not expected in HLO; guards against a malformed text.
      return
    for opcode, rest in computations.get(name, ()):
      collective = _OPCODE_TO_COLLECTIVE.get(opcode)
      if collective is not None:
        total[collective] += 1
        if looped:
          in_loop[collective] += 1
        if branched:
          in_branch[collective] += 1
        if not (looped or branched):
          outside[collective] += 1
      if opcode in _ASYNC_CONTINUATIONS:  # the same computation as its start.
        continue
      for attribute, called in _CALLED.findall(rest):
        for callee in called.strip("{}").split(","):
          callee = callee.strip().lstrip("%")
          if callee:
            visit(
                callee,
                looped or attribute in _LOOP_ATTRIBUTES,
                branched or attribute in _BRANCH_ATTRIBUTES,
                path | {name},
            )

  visit(entry, False, False, frozenset())
  return CollectiveCounts(
      total=dict(sorted(total.items())),
      in_loop=dict(sorted(in_loop.items())),
      in_branch=dict(sorted(in_branch.items())),
      outside=dict(sorted(outside.items())),
  )
