"""Whether every replicated leaf holds the same values on every device.

A leaf replicated over some mesh axes is a promise that each device holding
a copy holds the same copy: parameters and optimizer state after an update
that reduced the gradient over the data axes. A reduction missing for some
leaf (under ``pmap`` or ``shard_map``, a gradient that never met a ``psum``)
breaks it silently: the step runs, each device applies its own update and
the copies drift apart. No collective count shows that; the values do.
"""

from typing import Any, NamedTuple

import jax
import numpy as np

from optax_accum._src.mesh import readers
from optax_accum._src.proving import state_leaves


class ReplicaReport(NamedTuple):
  """What :func:`optax_accum.check_replicas` found.

  Attributes:
    ok: every copy of every checked leaf equals the others, bit for bit
      (NaN equal to NaN).
    worst: the path of the leaf whose copies differ most and that largest
      elementwise difference; None when ``ok``.
    differing: each leaf whose copies differ, with its largest difference.
    checked: how many leaves had copies to compare.
  """

  ok: bool
  worst: tuple[str, float] | None
  differing: tuple[tuple[str, float], ...]
  checked: int

  def __str__(self) -> str:
    if self.ok:
      return f"replicas: ok ({self.checked} leaves with copies compared)"
    rows = "\n".join(f"  {path}: {diff:.3g}" for path, diff in self.differing)
    return (f"replicas: {len(self.differing)} of {self.checked} leaves differ"
            f" between the devices holding a copy (largest difference):\n"
            f"{rows}")


def _set_mesh_axes() -> tuple:
  """The axes of the mesh ``jax.set_mesh`` set, if any."""
  mesh = jax.sharding.get_abstract_mesh()
  return () if mesh.empty else tuple(mesh.axis_names)


def _device_rows(x: Any) -> bool:
  """Whether ``x`` is laid out as a pmap lays out its outputs: one row per
  device, over the one axis of a mesh of Auto axes. Under ``jax.set_mesh``
  an array sharded over that mesh's axis is sharded (FSDP), not copies."""
  if not isinstance(x, jax.Array) or not x.ndim:
    return False
  sharding = x.sharding
  if type(sharding).__name__ == "PmapSharding":  # jax < 0.9 had its own.
    return True
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", ())
  if mesh is None or len(mesh.axis_names) != 1 or readers.are_explicit(
      mesh, tuple(mesh.axis_names)) or (
          mesh.axis_names[0] in _set_mesh_axes()):
    return False
  return (tuple(spec)[:1] == (mesh.axis_names[0],)
          and x.shape[0] == mesh.devices.size)


def pmap_style(arrays: list[Any]) -> bool:
  """Whether every array is a pmap's per-device rows (a pmap train state:
  parameters replicated by stacking, ``flax.jax_utils.replicate``)."""
  arrays = [x for x in arrays if isinstance(x, jax.Array) and x.ndim]
  return bool(arrays) and all(map(_device_rows, arrays))


def _host(x: Any) -> np.ndarray:
  x = np.asarray(x)
  return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _difference(a: np.ndarray, b: np.ndarray) -> float:
  """The largest elementwise difference: none where the values are equal
  (infinities too) or both NaN; inf where only one is NaN."""
  same = (a == b) | (np.isnan(a) & np.isnan(b))
  with np.errstate(invalid="ignore"):  # inf - inf, masked by ``same``.
    diff = np.where(same, 0.0, np.abs(a - b))
  return float(np.nan_to_num(diff, nan=np.inf, posinf=np.inf).max(
      initial=0.0))


def _copies(x: jax.Array, rows: bool) -> list[list[np.ndarray]]:
  """The values of ``x`` grouped by the part of it they hold; with
  ``rows``, each device's row is its copy."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  shards = x.addressable_shards
  if rows:
    return [[_host(s.data).reshape(s.data.shape[1:]) for s in shards]]
  groups: dict[Any, list[np.ndarray]] = {}
  for shard in shards:
    key = tuple((s.start, s.stop, s.step) for s in shard.index)
    groups.setdefault(key, []).append(_host(shard.data))
  return list(groups.values())


def leaf_difference(x: Any, rows: bool = False) -> float | None:
  """The largest difference between copies of ``x``; None if it has none.

  With ``rows``, ``x``'s rows are the devices' copies (a pmap's state).
  """
  if not isinstance(x, jax.Array) or readers.unreduced_axes(x):
    return None  # an unreduced array's values are partial sums, by design.
  groups = [g for g in _copies(x, rows and x.ndim > 0) if len(g) > 1]
  if not groups:
    return None
  return max(_difference(g[0], other) for g in groups for other in g[1:])


def check_replicas(tree: Any) -> ReplicaReport:
  """Whether each leaf's copies on different devices hold the same values.

  Every array leaf is read as it is laid out: devices that hold the same
  part of it (its replicas over some mesh axes) must hold the same values,
  bit for bit. A tree whose every array is laid out as :func:`jax.pmap`'s
  outputs (a leading axis of one row per device over a one-axis mesh, not
  the mesh ``jax.set_mesh`` set: there it is sharded) is a pmap train state:
  its rows are the devices' copies, as parameters replicated for ``pmap``
  are, so pass the leaves meant to be replicated. Leaves typed
  unreduced (partial sums by design), and the per-device running sums of an
  :class:`optax_accum.AccumulateState`, are skipped. On several processes,
  each compares the copies its own devices hold.

  Args:
    tree: any pytree (parameters, an optimizer state, a train state).

  Returns:
    A :class:`ReplicaReport`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import optax_accum as oa
    >>> same = jax.pmap(lambda x: x * 2)(jnp.ones((jax.device_count(), 3)))
    >>> oa.check_replicas({'w': same}).ok
    True
    >>> drift = jax.pmap(lambda x: x * 2)(
    ...     jnp.arange(jax.device_count() * 3.).reshape(-1, 3))
    >>> report = oa.check_replicas({'w': drift})
    >>> report.ok, report.worst[0]
    (False, "['w']")
  """
  skipped = state_leaves.field_paths(
      tree, state_leaves.RUNNING_SUMS + state_leaves.PER_DEVICE)
  kept = [leaf for leaf in state_leaves.leaves(tree)
          if not state_leaves.under(leaf.path, skipped)]
  rows = pmap_style([leaf.value for leaf in kept])
  differing, checked = [], 0
  for leaf in kept:
    diff = leaf_difference(leaf.value, rows)
    if diff is None:
      continue
    checked += 1
    if diff > 0:
      differing.append((leaf.path, diff))
  differing.sort(key=lambda row: -row[1])
  return ReplicaReport(ok=not differing,
                       worst=differing[0] if differing else None,
                       differing=tuple(differing), checked=checked)
