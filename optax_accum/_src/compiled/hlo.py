"""Counting the collectives of a compiled program, by where they run.

:func:`count_collectives` reads a compiled program (or its HLO text), finds
its collectives with ``hlo_text`` and counts them: inside loops, inside
branches, outside both, and by the mesh axes they span.
"""

import collections
import math
from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum._src import validation
from optax_accum._src.compiled import hlo_text

# hlo_text's, named here too: the collectives this counts, and one found.
COLLECTIVES = hlo_text.COLLECTIVES
Collective = hlo_text.Collective


class CollectiveCounts(NamedTuple):
  """Collectives of a compiled program, by where they run.

  Each field maps a collective's name (``"all-reduce"``, ``"reduce-scatter"``,
  ``"all-gather"``, ``"collective-permute"``, ``"all-to-all"``) to how many
  times it appears in the program text; names that do not appear are left out.
  A collective inside a loop body runs once per iteration; one inside a
  branch of a conditional runs only when that branch is taken, and so does
  one inside :func:`optax_accum.update_and_apply`'s emitting step, a loop
  of at most one trip (named ``optax_accum_at_most_once``), which counts as
  a branch.

  Attributes:
    total: everywhere in the program.
    in_loop: inside a while loop (a scan, a fori_loop): once per iteration.
    in_branch: inside a branch of a conditional (``lax.cond``), or of a
      loop of at most one trip (``optax_accum_at_most_once``).
    outside: neither in a loop nor in a branch: once per call.
    by_axes: with ``count_collectives(..., mesh=mesh)``, a dict from a tuple
      of mesh axis names (in mesh order) to the counts of the collectives
      whose device groups span exactly those axes; None without a mesh.
  """

  total: dict[str, int]  # everywhere in the program.
  in_loop: dict[str, int]  # inside a while loop (a scan, a fori_loop).
  in_branch: dict[str, int]  # inside a branch of a conditional (lax.cond).
  outside: dict[str, int]  # neither in a loop nor in a branch: once per call.
  # With count_collectives(mesh=...): the mesh axes a collective's device
  # groups span (in mesh order) -> the counts of those collectives alone.
  by_axes: dict[tuple[str, ...], "CollectiveCounts"] | None = None


def _device_assignment(compiled: Any) -> list[Any] | None:
  """The devices of a compiled program's logical ids, in order, or None.

  A program loaded on this process's devices tells them. One compiled for
  compile-only devices (``jax.experimental.topologies``) is never loaded and
  has none of its own: ``jit`` assigned it the devices of its arguments'
  shardings (they all agree), in the order of their mesh.
  """
  executable = compiled.runtime_executable()
  if hasattr(executable, "local_devices"):
    return list(executable.local_devices())
  for s in jax.tree.leaves((compiled.input_shardings,
                            compiled.output_shardings)):
    if (isinstance(s, jax.sharding.NamedSharding)
        and isinstance(s.mesh, jax.sharding.Mesh)):
      return list(s.mesh.devices.flat)
  return None


def logical_to_mesh_position(devices: list[Any] | None,
                              mesh: Any) -> np.ndarray:
  """For each logical device id of a program, its flat index in ``mesh``.

  ``devices`` are the program's own device assignment, where known. For HLO
  text, an abstract mesh, or a program spanning several processes, the
  mesh's own device order is assumed, which is the order ``jit`` under that
  mesh uses.
  """
  identity = np.arange(math.prod(mesh.axis_sizes))
  if devices is None or not isinstance(mesh, jax.sharding.Mesh):
    return identity
  if len(devices) != mesh.devices.size:  # several processes: local devices.
    return identity
  where = {device: i for i, device in enumerate(mesh.devices.flat)}
  if any(device not in where for device in devices):
    raise ValueError(
        f"mesh has devices {list(mesh.devices.flat)}, but the program runs on"
        f" {list(devices)}: pass the mesh the program was compiled for."
    )
  return np.array([where[device] for device in devices])


class _Tally:
  """Counts of collectives by place, filled while walking the program."""

  def __init__(self):
    self.total = collections.Counter()
    self.in_loop = collections.Counter()
    self.in_branch = collections.Counter()
    self.outside = collections.Counter()

  def add(self, collective: str, looped: bool, branched: bool) -> None:
    self.total[collective] += 1
    if looped:
      self.in_loop[collective] += 1
    if branched:
      self.in_branch[collective] += 1
    if not (looped or branched):
      self.outside[collective] += 1

  def counts(self, by_axes=None) -> CollectiveCounts:
    return CollectiveCounts(
        total=dict(sorted(self.total.items())),
        in_loop=dict(sorted(self.in_loop.items())),
        in_branch=dict(sorted(self.in_branch.items())),
        outside=dict(sorted(self.outside.items())),
        by_axes=by_axes,
    )


def read_program(program: Any) -> tuple[str, list[Any] | None]:
  """The optimized HLO text of ``program`` and its devices (None: unknown).

  Takes HLO text as is; a :class:`jax.stages.Compiled` (loaded, or compiled
  for compile-only devices); a :class:`jax.stages.Lowered`, compiled here;
  ``nnx.jit``'s stages, which hold jax's as ``.compiled`` and ``.lowered``;
  and a bare XLA executable (``compiled.runtime_executable()``).
  """
  if isinstance(program, str):
    return program, None
  # Flax's nnx.jit stages wrap jax's own (read by attribute: no flax import).
  if isinstance(getattr(program, "lowered", None), jax.stages.Lowered):
    program = program.lowered
  if isinstance(program, jax.stages.Lowered):
    program = program.compile()
  if isinstance(getattr(program, "compiled", None), jax.stages.Compiled):
    program = program.compiled
  if isinstance(program, jax.stages.Compiled):
    text = program.as_text()
    if isinstance(text, str):
      return text, _device_assignment(program)
  elif callable(getattr(program, "hlo_modules", None)):  # an XLA executable.
    devices = getattr(program, "local_devices", None)
    return ("\n\n".join(m.to_string() for m in program.hlo_modules()),
            None if devices is None else list(devices()))
  raise TypeError(
      "Expected a compiled program (jax.jit(f).lower(*args).compile(), or"
      " nnx.jit's), a lowered one, an XLA executable, or its HLO text, got"
      f" {type(program).__name__}."
  )


def count_collectives(
    program: Any,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    include_scalars: bool = True,
) -> CollectiveCounts:
  """Counts the collectives of a compiled program, inside and outside loops.

  Accumulating gradients should communicate once per optimizer update, not
  once per micro-batch. This reads the program that XLA actually runs (after
  sharding propagation and optimization) and reports how many all-reduces,
  reduce-scatters, all-gathers, collective-permutes and all-to-alls it has,
  and where: inside a while loop (the body of a :func:`jax.lax.scan` runs once
  per micro-batch), inside a branch of a conditional (such as the emitting
  branch of :func:`optax_accum.accumulate`, or its loop of at most one trip
  under :func:`optax_accum.update_and_apply`) or outside both. Counts are
  static: one per instruction in the program text, whatever the trip count.
  XLA's
  TPU compiler writes a reduce-scatter as an all-reduce and a slice fused
  under its ``AllReduceScatterFusion`` emitter: that counts as one
  reduce-scatter (of the fusion's result), which is what runs.

  With ``mesh``, the counts are also split by the mesh axes each collective
  runs over, read from its device groups (``replica_groups``, or a
  collective-permute's ``source_target_pairs``): the axes along which the
  devices of a group differ. On a model-parallel mesh this tells the gradient
  reduction over the data axes from the model's own collectives over the
  tensor axis. An axis of size 1 never appears (no group varies along it); a
  collective whose groups are single devices has the key ``()``; a reduction
  over every device has every axis of size above 1.

  Args:
    program: a compiled program (``jax.jit(f).lower(*args).compile()``, or
      the ``Compiled`` of ``nnx.jit``), including one compiled for
      compile-only devices (``jax.experimental.topologies``); a lowered one
      (it is compiled); an XLA executable
      (``compiled.runtime_executable()``); or its HLO text
      (``compiled.as_text()``). Each gives the counts its text gives.
    mesh: the :class:`jax.sharding.Mesh` the program was compiled for (or an
      :class:`jax.sharding.AbstractMesh` of its shape), to count by mesh axes.
      The device ids in HLO text are read in the mesh's device order
      (``mesh.devices.flat``), the order ``jit`` under the mesh uses; a
      compiled program's own device assignment is used when it has one
      (for compile-only devices, that of its arguments' shardings).
    include_scalars: False leaves out the collectives of scalars (a loss, a
      token count: what a loss on a batch sharded over the data axes reduces
      in every micro-batch), to see the gradient-sized ones. What XLA
      combined of scalars counts as scalars too: a tuple of scalars, and a
      collective of XLA's concatenation of scalars (a ``concatenate``, or a
      fusion whose root is one, of parts of one element each), such as the
      ``f32[2]`` all-reduce of a loss and a token count that XLA's GPU
      compiler makes. Read from the program's structure, not the sizes: a
      gradient of two elements is counted.

  Returns:
    A :class:`CollectiveCounts` of dicts mapping collective names to counts:
    ``total``, ``in_loop``, ``in_branch`` and ``outside``. A collective in a
    branch of a conditional inside a loop counts in both ``in_loop`` and
    ``in_branch``. With ``mesh``, ``by_axes`` maps each tuple of mesh axis
    names (in mesh order) to the :class:`CollectiveCounts` of the collectives
    over exactly those axes; without it, ``by_axes`` is None.

  Raises:
    TypeError: if ``program`` is none of the above.
    ValueError: if ``program`` is not compiled HLO, or with ``mesh`` if a
      collective's device groups name devices outside ``mesh`` or are written
      in a form this does not read.

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

    By mesh axis: on a 2 x 4 mesh, an all-reduce over ``'model'`` (devices
    0-3, 4-7) in the loop and one over ``'data'`` (0 and 4, 1 and 5, ...)
    after it, in two of the ways XLA writes device groups:

    >>> hlo = '''
    ... %body (p: f32[8]) -> f32[8] {
    ...   ROOT %m = f32[8] all-reduce(%p), replica_groups={{0,1,2,3},{4,5,6,7}}
    ... }
    ... ENTRY %main (x: f32[8]) -> f32[8] {
    ...   %w = f32[8] while(%x), condition=%cond, body=%body
    ...   ROOT %d = f32[8] all-reduce(%w), replica_groups=[4,2]<=[2,4]T(1,0)
    ... }'''
    >>> mesh = jax.sharding.AbstractMesh((2, 4), ('data', 'model'))
    >>> for axes, counts in oa.count_collectives(hlo, mesh).by_axes.items():
    ...   print(axes, counts.in_loop, counts.outside)
    ('data',) {} {'all-reduce': 1}
    ('model',) {'all-reduce': 1} {}
  """
  validation.check_mesh(mesh)
  validation.check_bool("include_scalars", include_scalars)
  tally = _Tally()
  tally_by_axes = collections.defaultdict(_Tally)
  for found in collectives(program, mesh):
    if found.scalar and not include_scalars:
      continue
    tally.add(found.collective, found.looped, found.branched)
    if mesh is not None:
      tally_by_axes[found.axes].add(found.collective, found.looped,
                                    found.branched)
  if mesh is None:
    return tally.counts()
  order = {name: i for i, name in enumerate(mesh.axis_names)}
  keys = sorted(tally_by_axes, key=lambda k: (len(k), [order[n] for n in k]))
  return tally.counts({axes: tally_by_axes[axes].counts() for axes in keys})


def collectives(program: Any, mesh: Any = None) -> list[Collective]:
  """Every collective of a compiled ``program``, with its bytes and axes."""
  text, devices = read_program(program)
  positions = None if mesh is None else logical_to_mesh_position(
      devices, mesh)
  return hlo_text.parse_collectives(text, positions, mesh)
