"""What several test files share (not a test module).

- Toy models on padded sequences. A batch holds ``x`` (rows, seq, dim),
  targets ``y`` (rows, seq) and a 0/1 ``mask`` (rows, seq) whose ones are each
  row's tokens: rows of different lengths give micro-batches with different
  token counts, which is what tells a token-weighted mean from a mean of
  micro-batch means. Every model returns per-token losses, already masked; the
  tests build their mean and sum losses on top.
- Micro-batches: the contiguous split that ``oa.value_and_grad`` makes.
- Tree comparison: one helper for "close", one for "bit for bit".
- The runner of a Markdown file's ```python blocks (README, docs).
- The environment of the worker scripts next to this file, and their runner
  (several JAX processes on loopback).
"""

import argparse
import collections
import importlib
import itertools
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum as oa
from optax_accum._src.compiled import hlo
from optax_accum._src.mesh import readers

SUPPORT = pathlib.Path(__file__).parent  # tests/support: helpers, workers.
ROOT = SUPPORT.parents[1]  # the repository root.


# Toy models.


def stacked_layers_loss(scan):
  """A summed squared error of a token embedding, layers ``tanh(h @ W_l)``
  stacked in ``params["layers"]`` and run by ``scan`` (``lax.scan`` or
  ``oa.scan_layers``), and an unembedding; ``batch``: ``ids`` and ``y``."""
  def loss(params, batch):
    h = params["embed"][batch["ids"]]
    h, _ = scan(lambda c, w: (jnp.tanh(c @ w), None), h, params["layers"])
    return (((h @ params["unembed"]) - batch["y"]) ** 2).sum()
  return loss


def padded_batch(rng: np.random.Generator, lengths, seq: int, dim: int):
  """A batch with ``lengths[i]`` tokens in row ``i``, as float32 numpy arrays.

  Draws ``x`` then ``y`` from ``rng``.
  """
  lengths = np.asarray(lengths)
  rows = len(lengths)
  return {
      "x": rng.normal(size=(rows, seq, dim)).astype(np.float32),
      "y": rng.normal(size=(rows, seq)).astype(np.float32),
      "mask": (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32),
  }


def num_tokens(batch):
  """The number of tokens in ``batch``: the sum of its mask."""
  return batch["mask"].sum()


def vector_params(size: int = 3):
  """One zero vector, ``{"w": zeros(size)}``: the smallest parameters."""
  return {"w": jnp.zeros(size)}


def layer_params(rows: int = 3, cols: int = 2):
  """A zero weight and bias, ``{"w": (rows, cols), "b": (cols,)}``."""
  return {"w": jnp.zeros((rows, cols)), "b": jnp.zeros(cols)}


def dense_params(width: int, seed: int = 0):
  """A square float32 weight ``w`` and a bias ``b``, drawn with ``seed``."""
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(width, width)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(width,)), jnp.float32)}


def linear_params(dim: int):
  """Parameters of :func:`linear_token_losses`: a weight vector and a bias."""
  return {"w": jnp.linspace(-1.0, 1.0, dim), "b": jnp.float32(0.3)}


def linear_token_losses(params, batch):
  """Squared error of ``tanh(x @ w + b)``, per token, masked."""
  pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return batch["mask"] * (pred - batch["y"]) ** 2


def mlp_params(dim: int, hidden: int, seed: int):
  """Parameters of :func:`mlp_token_losses`, drawn with ``seed``."""
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(size=(dim, hidden)), jnp.float32),
      "b1": jnp.asarray(rng.normal(size=(hidden,)) * 0.1, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(hidden,)), jnp.float32),
  }


def add_bias(x, bias):
  """``x + bias``, written so that JAX can type ``bias`` reduced.

  Under jit with Explicit data axes, JAX refuses ``x + bias`` with ``bias``
  reduced and ``x`` sharded over the same axes; broadcasting ``bias`` to
  ``x``'s sharding first is accepted (docs/distributed.md).
  """
  spec = readers.explicit_spec(x)
  if spec is None:
    return x + bias
  return x + jax.lax.broadcast_in_dim(
      bias, x.shape, (x.ndim - 1,), out_sharding=spec)


def mlp_token_losses(params, batch):
  """Squared error of a one-hidden-layer tanh network, per token, masked."""
  hidden = jnp.tanh(add_bias(batch["x"] @ params["w1"], params["b1"]))
  return batch["mask"] * (hidden @ params["w2"] - batch["y"]) ** 2


def safe_mean(token_losses, batch):
  """The mean over the batch's tokens; 0 (not 0/0) without any."""
  return token_losses.sum() / jnp.maximum(num_tokens(batch), 1.0)


def raw_mean(token_losses, batch):
  """The mean over the batch's tokens; 0/0 = NaN without any, on purpose."""
  return token_losses.sum() / num_tokens(batch)


# Micro-batches.


def uneven_micro_batches(num: int, seed: int, rows: int, seq: int, dim: int,
                         devices: int):
  """``num`` padded micro-batches of ``rows`` rows with uneven lengths, as
  jax arrays; in the second, the first device's rows have no token."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    lengths = rng.integers(0, seq + 1, size=rows)
    if i == 1:
      lengths[:rows // devices] = 0
    out.append(jax.tree.map(jnp.asarray, padded_batch(rng, lengths, seq, dim)))
  return out


def mlp_mean_loss(params, batch):
  """:func:`mlp_token_losses`' mean over the batch's tokens."""
  return safe_mean(mlp_token_losses(params, batch), batch)


def split(batch, num_microbatches: int):
  """The micro-batches of ``batch``, in order: contiguous blocks of rows."""
  size = len(jax.tree.leaves(batch)[0]) // num_microbatches
  return [
      jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch)
      for i in range(num_microbatches)
  ]


# Tree comparison.


def optimizer_k_step(micro_step, learning_rate=1e-2):
  """``make_step(k)`` for ``oa.check_k_invariance`` on a ``(model,
  optimizer)`` state: the optimizer's ``tx`` set to accumulate adamw over k,
  ``micro_step(model, optimizer, mb)`` run on each of the batch's k
  micro-batches."""

  def make_step(k):
    def step(state, batch):
      model, optimizer = state
      optimizer.tx = oa.accumulate(optax.adamw(learning_rate), every_k=k)
      for mb in split(batch, k):
        micro_step(model, optimizer, mb)
      return model, optimizer

    return step

  return make_step


def assert_trees_close(actual, expected, *, rtol=1e-6, atol=0.0):
  """Leaf by leaf ``|actual - expected| <= atol + rtol * |expected|``."""
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol)


def trees_close(actual, expected, *, rtol=1e-6, atol=0.0) -> bool:
  """Whether :func:`assert_trees_close` would pass."""
  try:
    assert_trees_close(actual, expected, rtol=rtol, atol=atol)
  except AssertionError:
    return False
  return True


def assert_trees_equal(actual, expected):
  """The same structure, dtypes and values, bit for bit."""
  chex.assert_trees_all_equal_structs(actual, expected)
  for leaf, expected_leaf in zip(
      jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
  ):
    assert leaf.dtype == expected_leaf.dtype, (leaf.dtype, expected_leaf.dtype)
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(expected_leaf))


def settled(tree):
  """``tree`` with the running sum of each ``AccumulateState`` that just
  emitted (``micro_step == 0``) zeroed: the next call discards it (its
  scratch is not part of the contract: ``tx.update`` leaves its updates
  there, ``emit.UpdatesInSum``, where ``oa.update_and_apply`` leaves the
  finished sum)."""
  is_state = lambda x: isinstance(x, oa.AccumulateState)

  def settle(node):
    if not is_state(node):
      return node
    return node._replace(grad_sum=jax.tree.map(
        lambda s: jnp.where(node.micro_step == 0, jnp.zeros_like(s), s),
        node.grad_sum))

  return jax.tree.map(settle, tree, is_leaf=is_state)


# Examples.

EXAMPLES = ROOT / "examples"


def import_example(script: str) -> types.ModuleType:
  """Imports ``examples/<script>.py`` the way running it would find its modules.

  ``script`` is e.g. ``"resume"`` or ``"train_lm/main"``. An example's modules
  import one another by bare name (``import train``), as flax's examples do,
  so its folder goes first on ``sys.path`` while it is imported. Its modules
  are then taken out of ``sys.modules`` again, so that two examples'
  ``train.py`` never meet; the returned module keeps them as attributes.
  """
  path = EXAMPLES / f"{script}.py"
  folder = str(path.parent)
  siblings = [sibling.stem for sibling in path.parent.glob("*.py")]
  sys.path.insert(0, folder)
  try:
    for name in siblings:
      sys.modules.pop(name, None)
    return importlib.import_module(path.stem)
  finally:
    sys.path.remove(folder)
    for name in siblings:
      sys.modules.pop(name, None)


def assert_flags_have_help_and_defaults(script: str, monkeypatch) -> None:
  """Every flag of ``examples/<script>.py`` says what it does and its default.

  ``monkeypatch`` is pytest's fixture: parsing the arguments stops the
  example before it does any work.
  """
  example = import_example(script)
  parsers = []

  def record(parser, *args, **kwargs):
    del args, kwargs
    parsers.append(parser)
    raise SystemExit(0)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
  with pytest.raises(SystemExit):
    example.main([])
  (parser,) = parsers
  flags = [action for action in parser._actions  # pylint: disable=protected-access
           if action.help != argparse.SUPPRESS
           and "-h" not in action.option_strings]
  assert flags, script
  printed = parser.format_help()
  for action in flags:
    assert action.help, action.option_strings  # says what the flag does
  assert len(re.findall(r"\(default:\s", printed)) == len(flags), printed


# Markdown snippets.


def run_markdown_snippets(path, min_blocks: int = 1) -> dict:
  """Runs the ```python blocks of ``path`` in order, in one namespace.

  Args:
    path: the Markdown file, absolute or relative to the repository root.
    min_blocks: fail unless the file has at least this many blocks, so that a
      changed fence does not silently turn the test into a no-op.

  Returns:
    The namespace the blocks ran in.
  """
  text = (ROOT / path).read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) >= min_blocks, (path, len(blocks))
  namespace = {}
  for block in blocks:
    exec(block, namespace)  # pylint: disable=exec-used
  return namespace


# Pairwise covering.


def pairwise_cover(dimensions: dict, allowed) -> list[dict]:
  """A small set of cells covering every allowed pair of values, greedily.

  Args:
    dimensions: ``{name: values}``, in order.
    allowed: ``allowed(cell) -> bool`` for a full cell ``{name: value}``.

  Returns:
    Cells (dicts) such that every pair of values of two dimensions that some
    allowed cell holds is held by one of them. Deterministic: the cell that
    covers the most uncovered pairs is taken first, the earliest in the
    product order on ties.
  """
  names = list(dimensions)
  cells = [
      dict(zip(names, values))
      for values in itertools.product(*dimensions.values())
  ]
  cells = [c for c in cells if allowed(c)]

  def pairs(cell):
    return frozenset(
        ((a, cell[a]), (b, cell[b]))
        for a, b in itertools.combinations(names, 2)
    )

  cell_pairs = [pairs(c) for c in cells]
  uncovered = set().union(*cell_pairs)
  chosen = []
  while uncovered:
    best = max(range(len(cells)),
               key=lambda i: (len(cell_pairs[i] & uncovered), -i))
    chosen.append(cells[best])
    uncovered -= cell_pairs[best]
  return chosen


# Collectives by mesh axes, read off the replica groups of compiled HLO.

_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_CALLS = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations)="
    r"(\{[^}]*\}|%?[^\s,)]+)")
_GROUP_OPS = re.compile(
    r"\b(all-reduce|reduce-scatter|all-gather)(?:-start)?\(")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def _replica_groups(line: str, num_devices: int) -> list[list[int]]:
  match = _IOTA_GROUPS.search(line)
  if match:
    shape = [int(n) for n in match.group(1).split(",")]
    ids = np.arange(num_devices).reshape(
        [int(n) for n in match.group(2).split(",")])
    if match.group(3):
      ids = ids.transpose([int(n) for n in match.group(3).split(",")])
    return ids.reshape(shape).tolist()
  match = _LIST_GROUPS.search(line)
  if match is None or not match.group(1):
    return [list(range(num_devices))]  # {} or none: every device.
  return [[int(n) for n in g.split(",") if n]
          for g in re.findall(r"\{([\d,]*)\}", match.group(1))]


def _spanned_axes(group, mesh_shape, axis_names) -> tuple[str, ...]:
  coords = np.array(np.unravel_index(group, mesh_shape)).T
  return tuple(name for i, name in enumerate(axis_names)
               if len(set(coords[:, i])) > 1)


def _scalars_only(rest: str, op: re.Match) -> bool:
  """Whether an instruction's result (before its opcode) is all scalars."""
  return all(not dims for dims in re.findall(r"\w+\[([\d,]*)\]",
                                             rest[:op.start()]))


def loop_collectives_by_axes(compiled, mesh_shape, axis_names,
                             include_scalars=True) -> dict:
  """``{(op, spanned mesh axes): count}`` of the collectives in while loops.

  ``op`` is "all-reduce", "reduce-scatter" or "all-gather"; the mesh axes
  are those along which a device group spans, device ``i`` of the program
  being the mesh's ``i``-th device in row-major order. (What
  ``oa.count_collectives(compiled, mesh=mesh).by_axes`` will say, read
  independently.)
  """
  computations, current = {}, None
  for line in compiled.as_text().splitlines():
    header = _HEADER.match(line)
    if header:
      current = computations.setdefault(header.group(2), [])
    elif line.startswith("}"):
      current = None
    elif current is not None:
      current.append(line)
  in_loop, todo = set(), []
  for lines in computations.values():
    for line in lines:
      if " while(" in line:
        todo += [c.lstrip("%") for k, c in _CALLS.findall(line)
                 if k == "body"]
  while todo:
    name = todo.pop()
    if name in in_loop or name not in computations:
      continue
    in_loop.add(name)
    for line in computations[name]:
      for _, called in _CALLS.findall(line):
        todo += [c.strip().lstrip("%") for c in called.strip("{}").split(",")]
  counts = collections.Counter()
  num_devices = int(np.prod(mesh_shape))
  for name in in_loop:
    for line in computations[name]:
      rest = line.split("=", 1)[-1]
      op = _GROUP_OPS.search(rest)
      if op is None or (not include_scalars and _scalars_only(rest, op)):
        continue
      for group in _replica_groups(line, num_devices)[:1]:
        counts[op.group(1), _spanned_axes(group, mesh_shape,
                                          axis_names)] += 1
  return dict(counts)


def reduction_bytes(compiled, mesh, data_axes, min_bytes=64):
  """Bytes of the gradient-sized reductions over ``data_axes``, by place.

  Counts all-reduces and reduce-scatters whose device groups span some of
  ``data_axes`` and whose result has at least ``min_bytes`` (scalars, such
  as a loss or a token count, are left out): ``{"loop": ..., "out": ...}``.
  """
  out = {"loop": 0, "out": 0}
  for c in hlo.collectives(compiled, mesh):
    if (c.collective in ("all-reduce", "reduce-scatter")
        and set(c.axes) & set(data_axes) and c.nbytes >= min_bytes):
      out["loop" if c.looped else "out"] += c.nbytes
  return out


# Worker scripts.


def worker_env(**overrides: str) -> dict[str, str]:
  """The environment to run a worker script of ``SUPPORT`` in.

  This process's environment and ``overrides``, with the repository root
  (for ``zoo``) and ``SUPPORT`` (for ``helpers``) first on ``PYTHONPATH``: a
  script run by path finds only its own folder.
  """
  env = dict(os.environ, **overrides)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), str(SUPPORT), os.environ.get("PYTHONPATH", ""))
      if p)
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(worker: pathlib.Path, args_of, num_processes: int,
                log_dir: pathlib.Path, timeout_s: float) -> None:
  """Runs ``num_processes`` JAX processes of ``worker`` on loopback.

  Process ``i`` gets the arguments ``args_of(i, port)`` (``port``: the
  coordinator's, free on 127.0.0.1). Waits for all, kills all on failure or
  timeout, and fails with each failed process's log.
  """
  env = worker_env(JAX_PLATFORMS="cpu")
  port = _free_port()
  names = [log_dir / f"{worker.stem}_{i}.log" for i in range(num_processes)]
  logs = [open(name, "w") for name in names]
  processes = [
      subprocess.Popen(
          [sys.executable, str(worker), *map(str, args_of(i, port))],
          env=env, stdout=logs[i], stderr=subprocess.STDOUT)
      for i in range(num_processes)
  ]
  deadline = time.monotonic() + timeout_s
  try:
    for process in processes:
      process.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
    for log in logs:
      log.close()
  failed = [f"process {i} exited with {p.returncode}:\n"
            + names[i].read_text()[-3000:]
            for i, p in enumerate(processes) if p.returncode != 0]
  assert not failed, "\n".join(failed)


def zero_mlp_loss(params, batch):
  """The ZeRO tests' MLP, ``tanh(x @ w1) @ w2 + sum(odd)``: the masked mean
  of its squared errors (``odd``'s 3 values divide by no data size)."""
  pred = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] + jnp.sum(
      params["odd"])
  err = batch["mask"] * (pred - batch["y"]) ** 2
  return err.sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def deferred_micro_step(loss_fn, tx):
  """docs/zero.md's one jit call per micro-batch: a
  ``gradient_sync="deferred"`` gradient into ``tx.update``, then
  ``oa.apply_if_updated``; ``(params, state, batch) -> (params, state)``."""
  grad_fn = oa.value_and_grad(loss_fn, num_microbatches=1,
                              num_tokens_fn=num_tokens,
                              gradient_sync="deferred")

  @jax.jit
  def micro_step(params, state, batch):
    _, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=num_tokens(batch))
    return oa.apply_if_updated(params, updates, state), state

  return micro_step


def clipped_adamw(updates: int):
  """Global-norm clipping at 0.5, then adamw with weight decay and a linear
  schedule over ``updates``: the chain the ZeRO tests train with."""
  return optax.chain(
      optax.clip_by_global_norm(0.5),
      optax.adamw(optax.linear_schedule(0.05, 0.01, updates),
                  weight_decay=0.1))
