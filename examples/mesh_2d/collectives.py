"""The collectives of a compiled program, by the mesh axis they run over.

``oa.count_collectives`` says where each collective runs (inside the
micro-batch loop or after it) but not over which devices. On a 2-D mesh both
matter: an all-reduce over ``model`` inside the loop is the model's own (a
row-parallel layer sums its partial outputs on every forward pass), while one
over ``data`` inside the loop would be the gradient synchronisation that
accumulation is meant to do once. Each collective's ``replica_groups`` in the
compiled HLO name the devices it combines; the mesh axes along which those
devices differ are the collective's axes.
"""

import math
import re

import jax
import numpy as np

import optax_accum as oa

# A collective's opcode: after the result's shape, before its operands.
_OPCODE = re.compile(
    r"(?<=\s)(all-reduce|all-gather|reduce-scatter|collective-permute"
    r"|ragged-all-to-all|all-to-all)(-start)?(?=\()"
)
# The three spellings of replica_groups that XLA prints.
_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\((?:\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))\))?"
    r"\s*\{([^}]*)\}")


def replica_groups(line: str, num_devices: int) -> np.ndarray | None:
  """The device groups of a collective's HLO line, one group per row.

  The numbers are logical device ids: positions in the program's device
  assignment, which for a program jitted under a mesh is the mesh's devices
  in order (``mesh.devices.flat``). None if the line names no groups this
  understands (e.g. a collective-permute's source-target pairs).
  """
  if match := _LISTED.search(line):
    groups = [[int(i) for i in group.split(",") if i.strip()]
              for group in re.findall(r"\{([^}]*)\}", match.group(1))]
    if not groups:  # replica_groups={}: all devices together.
      return np.arange(num_devices)[None]
    return np.array(groups)
  if match := _IOTA.search(line):  # [groups,size]<=[dims]T(perm)
    shape, dims, perm = (_ints(group) for group in match.groups())
    return _iota(dims, perm).reshape(shape)
  if match := _MESH.search(line):  # mesh[...], device_ids=(...) {axes}
    mesh_axes, dims, perm, listed, chosen = match.groups()
    sizes = {name: int(size) for name, size in
             re.findall(r"'([^']+)'=(\d+)", mesh_axes)}
    chosen = re.findall(r"'([^']+)'", chosen)
    names = list(sizes)
    if listed:
      ids = np.array(_ints(listed))
    elif dims:
      ids = _iota(_ints(dims), _ints(perm))
    else:
      ids = np.arange(math.prod(sizes.values()))
    ids = ids.reshape(list(sizes.values()))
    order = ([names.index(n) for n in names if n not in chosen]
             + [names.index(n) for n in chosen])
    group_size = math.prod(sizes[n] for n in chosen)
    return ids.transpose(order).reshape(-1, group_size)
  return None


def _ints(text: str | None) -> list[int] | None:
  return [int(i) for i in text.split(",")] if text else None


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  """XLA's iota device list: 0..n-1 shaped ``dims``, transposed by ``perm``."""
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def axes_of(groups: np.ndarray, mesh: jax.sharding.Mesh) -> str:
  """The mesh axes along which the devices of each group differ, e.g. "data"."""
  coords = np.stack(np.unravel_index(groups, mesh.devices.shape), -1)
  varies = (coords != coords[:, :1]).any(axis=(0, 1))
  return "+".join(name for name, v in zip(mesh.axis_names, varies) if v) or (
      "no axis")  # groups of one device: nothing to combine.


def count_by_axis(
    compiled: jax.stages.Compiled, mesh: jax.sharding.Mesh
) -> dict[str, oa.CollectiveCounts]:
  """``oa.count_collectives`` of ``compiled``, once per mesh axis.

  For each axis, the program text is counted with the other axes' collectives
  renamed to a non-collective opcode, so that ``oa.count_collectives`` places
  (in the loop, after it) only that axis's. Keys are axis names ("data",
  "model", "data+model" for a collective over both, "?" for groups this does
  not read); axes without collectives are absent.
  """
  lines = compiled.as_text().splitlines()
  labels = {}
  for i, line in enumerate(lines):
    if _OPCODE.search(line):
      groups = replica_groups(line, mesh.devices.size)
      labels[i] = "?" if groups is None else axes_of(groups, mesh)
  by_axis = {}
  for axis in sorted(set(labels.values())):
    text = "\n".join(
        _OPCODE.sub("custom-call", line, count=1)
        if labels.get(i, axis) != axis else line
        for i, line in enumerate(lines))
    by_axis[axis] = oa.count_collectives(text)
  return by_axis
