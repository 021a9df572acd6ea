"""A one-call check of a compiled train step: every micro-batch, one reduction.

:func:`check_train_step` reads the program XLA runs (as ``hlo`` does), finds
its micro-batch loop and, in an :func:`optax_accum.accumulate` micro-step,
the emitting branch (:mod:`step_reading`), and checks the two promises of
gradient accumulation that a bug breaks silently: the loop runs every
micro-batch, and the gradient is reduced over the data axes once per update.
What it finds wrong comes with the fix for the step's form: the typed
form's arguments under ``jax.jit``, the recipe's inside ``shard_map``.
"""

import math
from typing import Any, NamedTuple

import jax

from optax_accum._src import names
from optax_accum._src import validation
from optax_accum._src.compiled import step_reading
from optax_accum._src.mesh import readers

Loop, Reduction = step_reading.Loop, step_reading.Reduction

_PLACES = ("in_loop", "in_emitting_branch", "outside")


class TrainStepCheck(NamedTuple):
  """What :func:`optax_accum.check_train_step` found in a step that passed.

  The counts are of gradient-sized reductions (all-reduces and
  reduce-scatters that are not of scalars) over the data axes, by collective
  name, one per instruction of the program text.

  Attributes:
    trip_counts: how many times each micro-batch loop runs (None: not known
      at compile time); empty where the step has none.
    accumulate_step: whether the step has :func:`optax_accum.accumulate`'s
      emitting branch (a micro-step: the gradient is reduced only there).
    in_loop: inside a micro-batch loop, outside an emitting branch: once per
      micro-batch.
    in_emitting_branch: inside the emitting branch: once per update.
    outside: in neither: once per call.
    reduced_elements: with ``params``, for each data axis (of size above
      1), the elements the reductions over it sum (a reduce-scatter's
      whole); None without.
    gradient_elements: with ``params``, for each data axis, the elements of
      the gradient that a group of devices over it sums: each leaf of more
      than one element, divided by its shards over the other mesh axes;
      None without.
  """

  trip_counts: tuple[int | None, ...]  # of each micro-batch loop.
  accumulate_step: bool  # has accumulate's emitting branch.
  in_loop: dict[str, int]  # once per micro-batch.
  in_emitting_branch: dict[str, int]  # once per update.
  outside: dict[str, int]  # once per call.
  reduced_elements: dict[str, int] | None = None  # with params.
  gradient_elements: dict[str, int] | None = None  # with params.


class _Gradient(NamedTuple):
  """The gradient elements a group of devices over each data axis sums."""

  least: dict[str, int]  # each leaf's own shard, leaves reduced in stages.
  most: int  # each leaf once, whole but for its shards over other axes.
  smallest: dict[str, int]  # the smallest leaf's share of ``least``.


def _gradient_elements(params: Any, mesh: Any,
                       data_axes: tuple[str, ...]) -> _Gradient:
  """What the reductions over ``data_axes`` sum if each leaf is summed once.

  A leaf sharded over another mesh axis is reduced shard by shard. XLA may
  reduce a leaf over several data axes in stages (a reduce-scatter over one,
  then an all-reduce of the shard over the next), each over fewer elements.
  Leaves of one element are left out, as the reductions of scalars are.
  """
  sizes = readers.axis_sizes(mesh)
  least, smallest, most = dict.fromkeys(data_axes, 0), {}, 0
  for leaf in jax.tree.leaves(params):
    spec = readers.placed_spec(leaf)
    spec_axes = () if spec is None else readers.spec_names(spec)
    if (n := math.prod(leaf.shape)) <= 1:
      continue
    most += n // math.prod(sizes[a] for a in spec_axes if a not in data_axes)
    for axis in data_axes:
      share = n // math.prod(sizes[a] for a in spec_axes if a != axis)
      least[axis] += share
      smallest[axis] = min(smallest.get(axis, share), share)
  return _Gradient(least, most, smallest)


def _tally(reductions: list[Reduction], place: str) -> dict[str, int]:
  counts = {}
  for r in reductions:
    if r.place == place:
      counts[r.collective] = counts.get(r.collective, 0) + 1
  return dict(sorted(counts.items()))


def _loop_findings(loops: list[Loop], num_microbatches: int) -> list[str]:
  if not loops and num_microbatches > 1:
    return [f"no micro-batch loop of optax_accum found, nor a loop that"
            f" runs {num_microbatches} times (a model's own loops, such as"
            " scanned layers, are not micro-batch loops): the step computes"
            " one micro-batch per call, or the whole batch at once (is"
            " num_microbatches what the step was built with?)"]
  found = []
  for loop in loops:
    if loop.trip_count is None:
      found.append(
          f"the micro-batch loop {loop.name} has no trip count known at"
          " compile time (num_real_microbatches?): pass"
          " num_microbatches=None to skip this check")
    elif loop.trip_count != num_microbatches:
      dropped = num_microbatches - loop.trip_count
      found.append(
          f"the micro-batch loop {loop.name} runs {loop.trip_count} times,"
          f" expected {num_microbatches}" + (
              f": {dropped} of every {num_microbatches} micro-batches are"
              " never computed" if dropped > 0 else ""))
  return found


_DEFERRED = ("take the gradients with oa.value_and_grad(...,"
             " gradient_sync='deferred'), which leaves them unreduced")
_DEVICE_LOCAL = ("differentiate with respect to oa.device_local(params,"
                 " axis_name)")
_SCATTER_ASKED = ("reduce-scatter on every call: pass"
                  " gradient_sync='every_microbatch' here too; else")
_TYPED, _MANUAL = step_reading.TYPED, step_reading.MANUAL
# The fix for a reduction found where it runs too often, by where (in a
# micro-step or not), collective, and form: the typed form's arguments are
# not the shard_map recipe's. None: a form the program does not tell.
_FIXES = {
    (True, "all-reduce"): {
        _TYPED: f"{_DEFERRED} but for the leaves oa.sharding_report"
                " lists; ZeRO-2 is gradient_sync='every_microbatch' given to"
                " oa.accumulate (with shard_optimizer), not to"
                " oa.value_and_grad",
        _MANUAL: _DEVICE_LOCAL,
        None: f"under jax.jit with Explicit data axes, {_DEFERRED}; inside"
              f" jax.shard_map or jax.pmap, {_DEVICE_LOCAL}",
    },
    (True, "reduce-scatter"): {
        _TYPED: "ZeRO-2, gradient_sync='every_microbatch' given to"
                " oa.accumulate, and parameters sharded over the data axes"
                f" {_SCATTER_ASKED} {_DEFERRED}",
        _MANUAL: "parameters sharded over the data axes"
                 f" {_SCATTER_ASKED} {_DEVICE_LOCAL}",
        None: "ZeRO-2 and parameters sharded over the data axes"
              f" {_SCATTER_ASKED} under jax.jit with Explicit data axes,"
              f" {_DEFERRED}; inside jax.shard_map or jax.pmap,"
              f" {_DEVICE_LOCAL}",
    },
    (False, "all-reduce"): {
        _TYPED: "oa.sharding_report lists the leaves JAX cannot type"
                " reduced, reduced in the loop; a loop of jax.grad of your"
                " own reduces every micro-batch: take the gradient with"
                " oa.value_and_grad",
        _MANUAL: "a loop of jax.grad, or loss_fn's own collectives over the"
                 " data axes, reduce every micro-batch: take the gradient"
                 " with oa.value_and_grad(..., axis_name=...), which reduces"
                 " once, after its loop",
        None: "a loop of jax.grad reduces every micro-batch: take the"
              " gradient with oa.value_and_grad, which reduces once, after"
              " its loop",
    },
    (False, "reduce-scatter"): dict.fromkeys(
        (_TYPED, _MANUAL, None),
        "with gradient_sync='every_microbatch', pass it here too"),
}


def _reduction_findings(step: step_reading.Step, gradient_sync: str,
                        over: str) -> list[str]:
  """What is reduced where it runs more often than once per update."""
  found = []
  # A micro-step reduces only when it emits; a whole step only after the loop.
  wrong = ("in_loop", "outside") if step.accumulate_step else ("in_loop",)
  for collective in step_reading.REDUCTIONS:
    if collective == "reduce-scatter" and gradient_sync != names.ONCE:
      continue  # the FSDP policy's own, once per micro-batch.
    these = [r for r in step.reductions
             if r.collective == collective and r.place in wrong]
    if not these:
      continue
    what = (f"{len(these)} {collective}{'s' * (len(these) > 1)} of gradient"
            f" size ({sum(r.nbytes for r in these)} bytes) over {over}")
    where = ("outside oa.accumulate's emitting branch: the gradient is"
             " reduced on every micro-step" if step.accumulate_step else
             "inside the micro-batch loop: the gradient is reduced every"
             " micro-batch")
    fix = _FIXES[step.accumulate_step, collective][step.form]
    found.append(f"{what} {where}, not once per update ({fix})")
  return found


def _reduced_elements(reductions: list[Reduction],
                      data_axes: tuple[str, ...]) -> dict[str, int]:
  return {axis: sum(r.elements for r in reductions if axis in r.axes)
          for axis in data_axes}


def _count_findings(reductions: list[Reduction], gradient: _Gradient | None,
                    data_axes: tuple[str, ...], devices: int,
                    over: str) -> list[str]:
  """Whether the reductions sum the gradient, each leaf once."""
  if not reductions and devices > 1:
    return [f"no gradient-sized reduction over {over} ({devices} devices):"
            " the devices' gradients are never summed"]
  if gradient is None:
    return []
  found = []
  for axis, reduced in _reduced_elements(reductions, data_axes).items():
    what = f"the reductions over {axis!r} sum {reduced} gradient elements"
    if reduced < gradient.least[axis]:
      found.append(f"{what}, the gradient has {gradient.least[axis]}: some"
                   " leaf is not reduced over it")
    elif reduced >= gradient.most + gradient.smallest.get(axis, 0):
      found.append(f"{what}, the gradient has {gradient.most}: some leaf is"
                   " reduced more than once per update")
  return found


def check_train_step(
    program: Any,
    *,
    num_microbatches: int | None,
    data_axes: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    gradient_sync: str = "once",
    params: Any = None,
) -> TrainStepCheck:
  """Asserts that a compiled train step accumulates as promised, or raises.

  A one-line check for CI or step 0, on the program XLA runs (what
  :func:`optax_accum.count_collectives` reads): the micro-batch loop runs
  ``num_microbatches`` times (:func:`optax_accum.value_and_grad`'s loop, by
  its named scope, else the outermost loops; XLA's ``known_trip_count``,
  else the bound of the loop's condition), and each gradient-sized
  all-reduce or reduce-scatter over ``data_axes`` runs once per update:
  after the loop, or in an :func:`optax_accum.accumulate` micro-step's
  emitting branch. Reductions of scalars (a loss, a token count, a
  one-element leaf) may run anywhere. It reads the program's text: not the
  values, nor which branch runs when.

  Args:
    program: what :func:`optax_accum.count_collectives` takes: a compiled
      program (compile-only TPU and GPU ones too), a lowered one, an XLA
      executable, or its HLO text.
    num_microbatches: the micro-batches one call runs in its loop (1 for a
      micro-step of one micro-batch per call); None skips the trip count (a
      loop run ``num_real_microbatches`` times).
    data_axes: the mesh axes the batch is split over; None counts the
      reductions over any axes (data parallelism alone).
    mesh: the mesh the program was compiled for; by default that of a
      compiled program's arguments. Needed by ``data_axes`` and ``params``.
    gradient_sync: ``"every_microbatch"`` lets reduce-scatters run in the
      loop, as the FSDP policy of that name does, or on every call of a
      micro-step (ZeRO-2: :func:`optax_accum.accumulate`'s
      ``gradient_sync``; parameters sharded over the data axes).
    params: the parameters (arrays or :class:`jax.ShapeDtypeStruct`, with
      their shardings), to check that the reductions sum each leaf once:
      fewer elements than the gradient's, and some leaf is not reduced; a
      leaf's worth more, and one is reduced twice (an aux array reduced over
      the data axes counts too). Over several data axes, a leaf reduced in
      stages passes up to its whole size.

  Returns:
    A :class:`TrainStepCheck`: the loops' trip counts and where the
    gradient-sized reductions are.

  Raises:
    AssertionError: naming each thing found wrong, and its fix in the form
      the step runs in (``jax.jit`` with Explicit axes, or ``shard_map``).
    ValueError, TypeError: for arguments, as those of ``count_collectives``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> import optax_accum as oa
    >>> mesh = jax.make_mesh((8,), ('data',), axis_types=(AxisType.Auto,))
    >>> loss_fn = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> grad_fn = oa.value_and_grad(loss_fn, num_microbatches=4,
    ...                             axis_name='data', equal_weights=True)
    >>> step = jax.jit(jax.shard_map(grad_fn, mesh=mesh,
    ...                              in_specs=(P(), P('data')), out_specs=P()))
    >>> compiled = step.lower(jnp.ones(4), jnp.ones((64, 4))).compile()
    >>> oa.check_train_step(compiled, num_microbatches=4, data_axes='data',
    ...                     params=jnp.ones(4))
    TrainStepCheck(trip_counts=(4,), accumulate_step=False, in_loop={},
    in_emitting_branch={}, outside={'all-reduce': 1},
    reduced_elements={'data': 4}, gradient_elements={'data': 4})

    The same step checked against the 8 micro-batches it was meant to run:

    >>> oa.check_train_step(compiled, num_microbatches=8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: oa.check_train_step: the step does not accumulate as
    promised:
    - the micro-batch loop ... runs 4 times, expected 8: 4 of every 8
    micro-batches are never computed
  """
  if num_microbatches is not None:
    num_microbatches = validation.check_positive_int(
        "num_microbatches", num_microbatches)
  if gradient_sync not in names.CHOICES:
    raise ValueError(
        f"gradient_sync must be one of {names.CHOICES}, the value the step's"
        " oa.value_and_grad (one call per micro-batch: its oa.accumulate)"
        f" was given, got {gradient_sync!r}.")
  validation.check_mesh(mesh)
  program = step_reading.compiled(program)
  mesh = step_reading.program_mesh(program) if mesh is None else mesh
  data_axes = step_reading.check_data_axes(data_axes, mesh)
  if params is not None and mesh is None:
    raise ValueError("params needs the mesh the program was compiled for,"
                     " and this program does not tell it: pass mesh=mesh.")
  step = step_reading.read_step(program, mesh, data_axes, num_microbatches)
  sizes = {} if mesh is None else readers.axis_sizes(mesh)
  # The data axes that reduce anything (XLA drops a reduction over one).
  counted = tuple(a for a in (data_axes or tuple(sizes)) if sizes[a] > 1)
  gradient = None if params is None else _gradient_elements(
      params, mesh, counted)
  over = "any axes" if data_axes is None else str(data_axes)
  findings = (
      ([] if num_microbatches is None
       else _loop_findings(step.loops, num_microbatches))
      + _reduction_findings(step, gradient_sync, over)
      + _count_findings(step.reductions, gradient, counted,
                        math.prod(sizes[a] for a in counted), over))
  if findings:
    raise AssertionError(
        "oa.check_train_step: the step does not accumulate as promised:\n- "
        + "\n- ".join(findings))
  return TrainStepCheck(
      tuple(loop.trip_count for loop in step.loops), step.accumulate_step,
      *(_tally(step.reductions, place) for place in _PLACES),
      None if gradient is None else _reduced_elements(step.reductions,
                                                      counted),
      None if gradient is None else gradient.least)
