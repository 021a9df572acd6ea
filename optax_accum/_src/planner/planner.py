"""Choosing the number of micro-batches from compiled memory, before running.

Finding the number of micro-batches by trial and error costs an out-of-memory
crash and a recompilation per try. XLA knows, once a step is compiled and
before it runs, how much memory each device needs:
``compiled.memory_analysis().peak_memory_in_bytes``
(:func:`memory_analysis.device_memory`).
:func:`plan_microbatches` compiles candidate steps ahead of time, reads their
memory and their collectives, and returns the smallest number of
micro-batches that fits a per-device budget, with the FSDP policy
(:mod:`fsdp`) that communicates least.

This module compiles and measures the candidates (remembering what it
measured), chooses among them and reports the :class:`Plan`; the step they
are candidates of, checked, and each one's value-and-grad function come
from ``planner_step``.
"""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from optax_accum._src import names
from optax_accum._src import validation
from optax_accum._src.compiled import hlo
from optax_accum._src.compiled import memory_analysis
from optax_accum._src.microbatch import fsdp
from optax_accum._src.planner import planner_step

_PLANNED = ("num_microbatches", "gradient_sync", "gather_params")
_ONCE = fsdp.Policy()
# At a given k, a later group moves more collectives into the loop than an
# earlier one, so it is compiled only when nothing in the earlier ones fits.
_GROUPS = (
    (_ONCE,),
    (fsdp.Policy(names.EVERY_MICROBATCH, names.ONCE),
     fsdp.Policy(names.ONCE, names.EVERY_MICROBATCH)),
    (fsdp.Policy(names.EVERY_MICROBATCH, names.EVERY_MICROBATCH),),
)
_CACHE_SIZE = 256
_cache: dict[Any, "_Measured"] = {}


class _Measured(NamedTuple):
  """What compiling one candidate tells: memory and collectives.

  All None where the compiler refused the program for want of device
  memory (compile-only TPU devices: a program that exceeds the chip's HBM).
  """

  memory_bytes: int | None
  collectives: hlo.CollectiveCounts | None
  memory_measure: str | None


class Candidate(NamedTuple):
  """One compiled candidate step of :func:`plan_microbatches`."""

  num_microbatches: int
  gradient_sync: str
  gather_params: str
  # Per device: the peak (device_memory). None: the compiler refused the
  # program, more than the device's memory (it does not fit).
  memory_bytes: int | None
  collectives_per_update: int | None  # outside the loop + k * inside it.
  collectives: hlo.CollectiveCounts | None
  fits: bool  # memory_bytes <= the budget.
  # PEAK, or TEMP_AND_ARGS: temp + arguments + outputs - aliased, where the
  # backend counts no temporaries in its peak (XLA:CPU). None if refused.
  memory_measure: str | None = None


def _mib(num_bytes: int) -> str:
  return f"{num_bytes / 2**20:.2f} MiB"


class Table(tuple):
  """The candidates a plan considered, in order; ``print`` shows a table."""

  def __str__(self) -> str:
    header = ("k", "gradient_sync", "gather_params", "memory/device",
              "collectives/update = outside + k x in loop", "fits")
    rows = [header]
    for c in self:
      if c.memory_bytes is None:
        rows.append((str(c.num_microbatches), c.gradient_sync,
                     c.gather_params, "> device memory",
                     "(the compiler refused it)", "no"))
        continue
      in_loop = sum(c.collectives.in_loop.values())
      outside = c.collectives_per_update - c.num_microbatches * in_loop
      rows.append((
          str(c.num_microbatches), c.gradient_sync, c.gather_params,
          _mib(c.memory_bytes) + (
              "" if c.memory_measure == memory_analysis.PEAK
              else f" ({c.memory_measure})"),
          f"{c.collectives_per_update} = {outside} + {c.num_microbatches}"
          f" x {in_loop}",
          "yes" if c.fits else "no",
      ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
        for r in rows
    )


class Plan(NamedTuple):
  """What :func:`plan_microbatches` chose, and every candidate it compiled.

  Attributes:
    num_microbatches: the chosen ``k``.
    gradient_sync: the chosen ``gradient_sync`` policy, ``"once"`` or
      ``"every_microbatch"``.
    gather_params: the chosen ``gather_params`` policy, likewise.
    value_and_grad: :func:`optax_accum.value_and_grad` built with these
      settings.
    memory_bytes: the chosen step's memory per device, in bytes: its peak,
      ``memory_analysis().peak_memory_in_bytes`` (each buffer once,
      arguments and outputs included). Before issue 38 it was temp +
      arguments + outputs - aliased, which it still is where the backend
      counts no temporaries in its peak (XLA:CPU): ``memory_measure``.
    collectives_per_update: the chosen step's collectives per update: those
      outside the loop + ``k`` times those inside it.
    table: every candidate compiled, in order; ``print`` shows it aligned
      (a memory read as temp + args is marked ``(temp+args)``).
    memory_measure: ``"peak"``, or ``"temp+args"`` where the backend gives
      no peak that counts temporaries (an upper bound).
  """

  num_microbatches: int
  gradient_sync: str
  gather_params: str
  value_and_grad: Callable[..., Any]  # oa.value_and_grad with these settings.
  memory_bytes: int  # the chosen step's peak, per device.
  collectives_per_update: int  # the chosen step's.
  table: Table
  # memory_analysis.PEAK, or TEMP_AND_ARGS: how memory_bytes was read.
  memory_measure: str = memory_analysis.PEAK


def _hashable(value: Any) -> Any:
  """``value`` as a cache key, or TypeError if it cannot be one."""
  leaves, treedef = jax.tree.flatten(
      value, is_leaf=lambda x: isinstance(x, P) or x is None
  )
  key = (treedef, tuple(leaves))
  hash(key)
  return key


def _signature(tree: Any) -> Any:
  """The shapes, dtypes and shardings that a compiled step depends on."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
      (jax.numpy.shape(x), jax.numpy.result_type(x),
       getattr(x, "sharding", None), getattr(x, "weak_type", None))
      for x in leaves
  )


def _measure(fn: Callable[..., Any], step: planner_step.Step) -> _Measured:
  """Compiles the step around ``fn`` ahead of time and measures it."""
  if step.wrap is not None:
    fn = step.wrap(fn)
  lowered = jax.jit(fn).lower(*step.operands, **step.call_kwargs)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if memory_analysis.refused_for_memory(e):
      return _Measured(None, None, None)
    e.add_note("plan_microbatches: compiling this candidate failed; a"
               " compiler refusal for want of memory (RESOURCE_EXHAUSTED)"
               " would have counted as 'does not fit'.")
    raise
  memory = memory_analysis.device_memory(compiled)
  if memory is None:
    raise RuntimeError(
        f"The {memory_analysis.compiled_platform(compiled)} backend does not"
        " report memory (compiled.memory_analysis() is None):"
        " plan_microbatches cannot plan on it."
    )
  return _Measured(memory_bytes=memory.memory_bytes,
                   collectives=hlo.count_collectives(compiled),
                   memory_measure=memory.measure)


def _per_update(counts: hlo.CollectiveCounts | None, k: int) -> int | None:
  if counts is None:
    return None
  in_loop = sum(counts.in_loop.values())
  return sum(counts.total.values()) - in_loop + k * in_loop


def _no_fit(table: Table, budget: int) -> ValueError:
  measured = [c for c in table if c.memory_bytes is not None]
  if not measured:
    return ValueError(
        f"No candidate fits memory_budget={budget} bytes ({_mib(budget)}) per"
        " device: the compiler refused every one, each needs more than the"
        " device's memory. Use more micro-batches (candidates=), shard the"
        " parameters over the data axis, or use more devices.\n"
        f"{table}"
    )
  smallest = min(measured, key=lambda c: c.memory_bytes)
  return ValueError(
      f"No candidate fits memory_budget={budget} bytes ({_mib(budget)}) per"
      f" device: the smallest needs {smallest.memory_bytes} bytes"
      f" ({_mib(smallest.memory_bytes)}) with num_microbatches="
      f"{smallest.num_microbatches}, gradient_sync={smallest.gradient_sync!r},"
      f" gather_params={smallest.gather_params!r}. Raise the budget, shard"
      " the parameters over the data axis, or use more devices.\n"
      f"{table}"
  )


def _key(step: planner_step.Step, k: int, chosen: fsdp.Policy) -> Any:
  """The cache key of one candidate, or None if something is unhashable."""
  try:
    key = (step.loss_fn, step.encode_fn, step.wrap, k, chosen,
           _hashable(sorted(step.vg_kwargs.items())),
           _signature((step.operands, step.call_kwargs)),
           jax.sharding.get_abstract_mesh())
    hash(key)
  except TypeError:
    return None
  return key


def plan_microbatches(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *args: Any,
    memory_budget: int,
    candidates: Iterable[int] | None = None,
    rng: Any = None,
    loss_kwargs: dict[str, Any] | None = None,
    encode_fn: Callable[..., Any] | None = None,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    **vg_kwargs: Any,
) -> Plan:
  """The fewest micro-batches whose compiled step fits a memory budget.

  Compiles :func:`optax_accum.value_and_grad` steps ahead of time
  (``jax.jit(fn).lower(params, batch, *args).compile()``, nothing runs) and
  reads each one's per-device memory, its peak (``memory_analysis()``'s
  ``peak_memory_in_bytes``: each buffer once, arguments and outputs
  included; where the backend counts no temporaries in its peak, XLA:CPU,
  temp + arguments + outputs - aliased, marked ``"temp+args"``) and its
  collectives per update (outside the loop + ``k`` times inside it, from
  :func:`optax_accum.count_collectives`).
  It returns the smallest ``k`` for which some step fits ``memory_budget``
  and, among the steps that fit at that ``k``, the ``gradient_sync`` /
  ``gather_params`` policy that communicates least (then the one with less
  memory).

  The divisors of the per-device batch size are scanned in increasing order
  (memory need not fall monotonically with ``k``, so there is no bisection).
  What cannot win is not compiled: a larger ``k`` once a smaller one fits,
  and at a given ``k`` the policies that move collectives into the loop when
  one that moves fewer fits. With ``k = 1`` XLA removes the loop and all four
  policies compile to the same program, so only the default is tried; so it
  is when no parameter is sharded over ``axis_name``. Measurements are
  cached, so planning again (another budget) recompiles nothing.

  It plans for hardware this machine lacks from abstract inputs sharded over
  compile-only devices (``jax.experimental.topologies.get_topology_desc``
  with libtpu or the CUDA plugin installed: ``docs/planner.md``), the budget
  being one chip's memory. A candidate the compiler refuses for want of
  device memory (XLA's TPU compiler refuses a program larger than the chip's
  HBM, status ``RESOURCE_EXHAUSTED``) does not fit: its row in the table
  says so, with no memory or collectives.

  Args:
    loss_fn: as for :func:`optax_accum.value_and_grad`.
    params: the parameters, as arrays or :class:`jax.ShapeDtypeStruct`
      (with their shardings: FSDP parameters are sharded over the data axis).
      Abstract inputs plan a model too large for this machine without
      allocating it.
    batch: the global batch, arrays or ShapeDtypeStructs. With
      ``has_state=True`` pass the operands as the step takes them:
      ``plan_microbatches(loss_fn, params, model_state, batch, *args, ...)``.
    *args: further arguments of ``loss_fn``.
    memory_budget: bytes per device that the step may use.
    candidates: the numbers of micro-batches to consider; by default every
      divisor of the per-device batch size.
    rng: the PRNG key (or its ShapeDtypeStruct) the step is called with, if
      ``loss_fn`` takes ``rng=`` (dropout).
    loss_kwargs: keyword arguments the step passes on to ``loss_fn``.
    encode_fn: plans :func:`optax_accum.coupled_value_and_grad` (``encode_fn``,
      ``loss_fn``) instead: a coupled loss, whose parameters are held whole
      (only ``"once"`` policies).
    wrap: ``wrap(fn)`` is the function to compile around the candidate
      ``fn``, e.g. ``lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=...,
      out_specs=...)`` for a step that runs inside shard_map (``axis_name``
      then names its manual axis). By default ``fn`` itself, under
      :func:`jax.jit`.
    **vg_kwargs: the other arguments of :func:`optax_accum.value_and_grad`
      (``num_tokens_fn``, ``axis_name``, ``param_specs``, ``has_state``,
      ...). With ``axis_name``, call this under ``jax.set_mesh(mesh)`` or
      pass inputs sharded over a mesh with Explicit axes.

  Returns:
    A :class:`Plan`: ``num_microbatches``, ``gradient_sync``,
    ``gather_params``, ``value_and_grad`` (built with them), the chosen
    step's ``memory_bytes`` and ``collectives_per_update``, ``table``,
    every candidate compiled (``print(plan.table)`` shows it), and
    ``memory_measure`` (``"peak"`` or ``"temp+args"``).

  Raises:
    ValueError: if no candidate fits; the message names the smallest
      requirement and prints the table.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_accum as oa
    >>> def loss_fn(w, mb):
    ...   return jnp.mean(jnp.tanh(mb['x'] @ w) ** 2)
    >>> w, batch = jnp.ones((64, 64)), {'x': jnp.ones((32, 64))}
    >>> plan = oa.plan_microbatches(loss_fn, w, batch, memory_budget=2**30,
    ...                             equal_weights=True)
    >>> plan.num_microbatches, plan.gradient_sync, plan.gather_params
    (1, 'once', 'once')
    >>> loss, grads = plan.value_and_grad(w, batch)
    >>> oa.plan_microbatches(loss_fn, w, batch, memory_budget=1000,
    ...                      equal_weights=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: No candidate fits memory_budget=1000 bytes (0.00 MiB) per ...
  """
  budget = validation.check_positive_int("memory_budget", memory_budget)
  for name in _PLANNED:
    if name in vg_kwargs:
      raise TypeError(
          f"plan_microbatches chooses {name}: do not pass it (got"
          f" {name}={vg_kwargs[name]!r})."
      )
  step = planner_step.checked_step(
      loss_fn, (params, batch, *args), rng, loss_kwargs, encode_fn, wrap,
      vg_kwargs)
  rows = planner_step.rows_per_device(step)
  groups = _GROUPS if planner_step.has_fsdp_params(step) else _GROUPS[:1]
  table = []
  for k in planner_step.check_candidates(candidates, rows):
    for group in groups if k > 1 else _GROUPS[:1]:
      rows_k = [_candidate(step, k, chosen, budget) for chosen in group]
      table.extend(rows_k)
      fitting = [c for c in rows_k if c.fits]
      if fitting:
        best = min(fitting, key=lambda c: (c.collectives_per_update,
                                           c.memory_bytes))
        return Plan(
            best.num_microbatches, best.gradient_sync, best.gather_params,
            planner_step.build_step(step, k, fsdp.Policy(*best[1:3])),
            best.memory_bytes, best.collectives_per_update, Table(table),
            best.memory_measure)
  raise _no_fit(Table(table), budget)


def _candidate(step: planner_step.Step, k: int, chosen: fsdp.Policy,
               budget: int) -> Candidate:
  """Compiles (or looks up) and measures one candidate step."""
  key = _key(step, k, chosen)
  measured = _cache.get(key) if key is not None else None
  if measured is None:
    measured = _measure(planner_step.build_step(step, k, chosen), step)
    if key is not None:
      if len(_cache) >= _CACHE_SIZE:
        del _cache[next(iter(_cache))]
      _cache[key] = measured
  return Candidate(
      k, chosen.gradient_sync, chosen.gather_params, measured.memory_bytes,
      _per_update(measured.collectives, k), measured.collectives,
      measured.memory_bytes is not None and measured.memory_bytes <= budget,
      measured.memory_measure)
