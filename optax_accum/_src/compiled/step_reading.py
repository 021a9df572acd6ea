"""What a compiled train step does, read from its text: its micro-batch
loops (their trip counts), where its gradient-sized reductions run, and
the form it runs in (under ``jax.jit`` with Explicit axes, or inside a
``shard_map``), which decides the fix for what is wrong.

The walk of the HLO is ``parse_collectives``', on ``hlo_text``'s parser,
keeping which loops and branches enclose each
instruction, where ``parse_collectives`` keeps only whether some do.
:func:`optax_accum.check_train_step` judges what this reads.
"""

import math
import re
from typing import Any, NamedTuple

import jax

from optax_accum._src import names
from optax_accum._src.compiled import async_chains
from optax_accum._src.compiled import hlo
from optax_accum._src.compiled import hlo_text
from optax_accum._src.mesh import readers

# The named scopes of the micro-batch loop and of accumulate's emitting
# branch, as the op_name metadata of the compiled program has them.
_LOOP_OP_NAME = re.compile(re.escape(names.LOOP_SCOPE) + r"/while$")
# The last micro-batch, where it runs after the loop: one more trip.
_PEELED = re.compile(re.escape(names.PEELED_SCOPE) + r"(?:/|$)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_INT_CONSTANT = re.compile(r"=\s*[su](?:8|16|32|64)\[\]\S*\s+constant\((\d+)\)")
_CONDITION = re.compile(r"\bcondition=%?([^\s,)]+)")
_CALLS = re.compile(r"\bcalls=%?([^\s,)]+)")
REDUCTIONS = ("all-reduce", "reduce-scatter")
# The forms a step's fixes differ by (docs/distributed.md): ``jax.jit`` with
# Explicit data axes, and ``jax.shard_map`` or ``jax.pmap`` (with the auto
# form, whose loop runs in a shard_map of ours).
TYPED, MANUAL = "typed", "manual"
_IN_SHARD_MAP = re.compile(r"(?:^|/)(?:shard_map|pmap\()")


class Instruction(NamedTuple):
  """An instruction of the program, and the loops and branches around it."""

  opcode: str
  rest: str  # the text from the opcode on.
  line: str
  computation: str
  loops: tuple[str, ...]  # the enclosing while instructions, outermost first.
  branches: tuple[str, ...]  # the enclosing branch computations.
  scatter: str | None  # the line of XLA's TPU reduce-scatter fusion around.


class Loop(NamedTuple):
  name: str  # the while instruction's.
  trip_count: int | None
  marked: bool  # oa.value_and_grad's, by its named scope.
  outermost: bool


class Reduction(NamedTuple):
  collective: str  # "all-reduce" or "reduce-scatter".
  place: str  # "in_loop", "in_emitting_branch" or "outside".
  nbytes: int
  axes: tuple[str, ...] | None  # the mesh axes it spans; None without a mesh.
  elements: int | None  # the gradient elements summed; None without a mesh.


def walk(entry: str, computations: dict[str, Any]):
  """Every instruction reached from ``entry``, as ``hlo_text`` walks them."""

  def visit(name, loops, branches, path, scatter):
    if name in path:
      return
    for opcode, rest, line in computations.get(name, ()):
      yield Instruction(opcode, rest, line, name, loops, branches, scatter)
      if opcode in hlo_text.ASYNC_CONTINUATIONS:
        continue
      fused = line if hlo_text.is_reduce_scatter_fusion(line) else None
      here = hlo_text.instruction_name(line)
      for attribute, called in hlo_text.CALLED.findall(rest):
        for callee in called.strip("{}").split(","):
          callee = callee.strip().lstrip("%")
          if not callee:
            continue
          place = hlo_text.enclosure(opcode, rest, attribute)
          if place == "loop":
            inner_loops, inner_branches = loops + (here,), branches
          elif place == "branch":
            inner_loops, inner_branches = loops, branches + (callee,)
          else:
            inner_loops, inner_branches = loops, branches
          yield from visit(callee, inner_loops, inner_branches, path | {name},
                           fused if attribute == "calls" else scatter)

  yield from visit(entry, (), (), frozenset(), None)


def trip_count(rest: str, computations: dict[str, Any]) -> int | None:
  """XLA's ``known_trip_count`` of a while, else its condition's one bound."""
  if match := _KNOWN_TRIP_COUNT.search(rest):
    return int(match.group(1))
  condition = _CONDITION.search(rest)
  if condition is None:
    return None
  # The condition's constants, and those of the fusions it calls (XLA's GPU
  # compiler fuses the compare with its bound).
  lines = list(computations.get(condition.group(1), ()))
  lines += [fused for _, _, line in lines for callee in _CALLS.findall(line)
            for fused in computations.get(callee, ())]
  bounds = {int(m.group(1)) for _, _, line in lines
            if (m := _INT_CONSTANT.search(line))}
  return bounds.pop() if len(bounds) == 1 else None


def microbatch_loops(instructions, computations,
                      num_microbatches: int | None) -> list[Loop]:
  """The micro-batch loops: oa.value_and_grad's, else the outermost ones
  that run ``num_microbatches`` times.

  Without the named scope (a hand-written loop, coupled_value_and_grad's
  two), an outermost loop of ``num_microbatches`` trips (or of a count
  not known at compile time) is taken. Another
  loop is the model's own (its layers scanned, a decoding loop), not a
  loop over micro-batches: a full-batch step whose model scans its layers
  has no micro-batch loop. A step of one micro-batch may have none either.
  """
  loops = []
  for inst in instructions:
    if inst.opcode == "while" and not hlo_text.runs_at_most_once(inst.rest):
      op_name = _OP_NAME.search(inst.rest)
      loops.append(Loop(
          hlo_text.instruction_name(inst.line),
          trip_count(inst.rest, computations),
          bool(op_name and _LOOP_OP_NAME.search(op_name.group(1))),
          not inst.loops))
  loops = list({loop.name: loop for loop in loops}.values())
  if marked := [loop for loop in loops if loop.marked]:
    if len(marked) == 1 and marked[0].trip_count is not None and any(
        is_peeled(inst) for inst in instructions):
      # Its last micro-batch runs after it (SPEC 13).
      return [marked[0]._replace(trip_count=marked[0].trip_count + 1)]
    return marked
  if num_microbatches == 1:
    return []
  return [loop for loop in loops if loop.outermost
          and loop.trip_count in (num_microbatches, None)]


def is_peeled(inst: Instruction) -> bool:
  """Whether ``inst`` is the last micro-batch's, run after the loop."""
  op_name = _OP_NAME.search(inst.rest)
  return bool(not inst.loops and op_name and _PEELED.search(op_name.group(1)))


def place(inst: Instruction, loop_names: set[str],
           emitting: set[str]) -> str:
  """Where ``inst`` runs. The last micro-batch run after the loop
  (``overlap_reduction=True``) holds no reduction of its own over the data
  axes (it leaves the loop only where none is in it): what XLA's combiner
  merges with its scalars is the one after the loop, ``"outside"``."""
  if set(inst.branches) & emitting:
    return "in_emitting_branch"
  if set(inst.loops) & loop_names:
    return "in_loop"
  return "outside"


def reductions(instructions, computations, loop_names, emitting,
                positions, mesh, data_axes) -> list[Reduction]:
  """The gradient-sized reductions over ``data_axes`` (None: any), placed.

  A reduction in a loop of the model's own (its scanned layers, where
  ``oa.scan_layers`` reduces each layer's slice in the backward loop) sums
  its elements once per trip: counted that many times.
  """
  trips = {hlo_text.instruction_name(inst.line):
           trip_count(inst.rest, computations)
           for inst in instructions if inst.opcode == "while"}
  found = []
  for inst in instructions:
    collective = hlo_text.OPCODE_TO_COLLECTIVE.get(inst.opcode)
    if inst.scatter is not None and collective == "all-reduce":
      collective = "reduce-scatter"  # XLA's TPU reduce-scatter fusion.
    if collective not in REDUCTIONS or async_chains.is_chain_copy(
        inst.rest, inst.computation, computations):
      continue
    shapes = hlo_text.result_shapes(inst.scatter or inst.line)
    if hlo_text.is_scalar_sum(inst.rest, shapes, inst.computation,
                              computations):
      continue
    axes = elements = None
    if mesh is not None:
      axes = hlo_text.collective_axes(inst.rest, positions, mesh)
      if data_axes is not None and not set(axes) & set(data_axes):
        continue
      elements = sum(n for _, dims in shapes if (n := math.prod(dims)) > 1)
      elements *= math.prod(trips.get(loop) or 1 for loop in inst.loops
                            if loop not in loop_names)
      if collective == "reduce-scatter":
        elements *= math.prod(mesh.shape[a] for a in axes)
    found.append(Reduction(
        collective, place(inst, loop_names, emitting),
        sum(hlo_text.ITEMSIZE[t] * math.prod(d) for t, d in shapes),
        axes, elements))
  return found


def compiled(program: Any) -> Any:
  """A lowered program compiled (flax's nnx.jit stages too), else as is."""
  if isinstance(getattr(program, "lowered", None), jax.stages.Lowered):
    program = program.lowered
  if isinstance(program, jax.stages.Lowered):
    program = program.compile()
  return program


def program_mesh(program: Any) -> Any:
  """The mesh of a compiled program's arguments or results, or None."""
  for stage in (program, getattr(program, "compiled", None)):
    if isinstance(stage, jax.stages.Compiled):
      for s in jax.tree.leaves((stage.input_shardings,
                                stage.output_shardings)):
        if isinstance(s, jax.sharding.NamedSharding):
          return s.mesh
  return None


def form(instructions, mesh: Any,
         data_axes: tuple[str, ...] | None) -> str | None:
  """The step's form: ``MANUAL`` where our loop or emitting branch runs in a
  shard_map (without either, where anything does), else ``TYPED`` where the
  data axes are Explicit; None where the program does not tell (no mesh,
  Auto axes under jit: XLA places the collectives).

  Only what comes before our named scopes counts: the typed form's ZeRO
  reduce-scatters run in shard_maps of ours, inside the emitting branch.
  """
  op_names = [m.group(1) for inst in instructions
              if (m := _OP_NAME.search(inst.rest))]
  outer = [name.split(scope)[0] for name in op_names
           for scope in (names.LOOP_SCOPE, names.EMIT_SCOPE) if scope in name]
  if any(_IN_SHARD_MAP.search(name) for name in outer or op_names):
    return MANUAL
  if mesh is not None and readers.are_explicit(
      mesh, data_axes or tuple(mesh.axis_names)):
    return TYPED
  return None


def check_data_axes(data_axes: Any, mesh: Any) -> tuple[str, ...] | None:
  """``data_axes`` as a tuple of ``mesh``'s axis names (None for None), or an
  error naming what is wrong with it."""
  if data_axes is None:
    return None
  axis_names = data_axes if isinstance(data_axes, tuple) else (data_axes,)
  if not axis_names or not all(isinstance(n, str) for n in axis_names):
    raise TypeError(
        "data_axes must be None, a mesh axis name or a tuple of them, got"
        f" {data_axes!r}.")
  if mesh is None:
    raise ValueError(
        f"data_axes={data_axes!r} needs the mesh the program was compiled"
        " for, and this program does not tell it: pass mesh=mesh.")
  if missing := [n for n in axis_names if n not in mesh.axis_names]:
    raise ValueError(
        f"data_axes={data_axes!r} names {missing}, not an axis of the mesh"
        f" {tuple(mesh.axis_names)}: pass the axes the batch is split over.")
  return axis_names


class Step(NamedTuple):
  """What the program text tells: its micro-batch loops and reductions."""

  loops: list[Loop]
  accumulate_step: bool  # it has accumulate's emitting branch.
  reductions: list[Reduction]  # gradient-sized, over the data axes.
  form: str | None = None  # TYPED, MANUAL or None (not told).


def read_step(program: Any, mesh: Any, data_axes: tuple[str, ...] | None,
               num_microbatches: int | None) -> Step:
  """Reads ``program``'s text: where its loops and reductions are."""
  text, devices = hlo.read_program(program)
  entry, computations = hlo_text.parse(text)
  instructions = list(walk(entry, computations))
  loops = microbatch_loops(instructions, computations, num_microbatches)
  branches = {b for inst in instructions for b in inst.branches}
  emitting = {b for b in branches
              if any(names.EMIT_SCOPE in line
                     for *_, line in computations.get(b, ()))}
  positions = None if mesh is None else hlo.logical_to_mesh_position(
      devices, mesh)
  return Step(
      loops, any(names.EMIT_SCOPE in inst.line for inst in instructions),
      reductions(instructions, computations, {loop.name for loop in loops},
                  emitting, positions, mesh, data_axes),
      form(instructions, mesh, data_axes))
