"""Counts copies, selects, fusions and conditionals in compiled HLO.

XLA's CPU backend may insert ``copy`` instructions into a ``lax.cond`` for
buffers that a branch passes through unchanged. This script compiles the very
programs that the benchmarks time (``train_steps.py``): the train step
``u, s = tx.update(g, s, p); p = optax.apply_updates(p, u)`` with ``p`` and
``s`` donated, and ``tx.update`` alone with ``g`` and ``s`` donated, for
``oa.accumulate(adamw)`` and for ``optax.MultiSteps(adamw)``, and prints, per
computation, the copies and how many bytes they move, naming the branches of
each conditional. Benchmarks b and e import ``hlo_stats`` from here.

Usage::

  python benchmarks/hlo_report.py [--leaves 10 --size 1024] [--dump DIR]
"""

import argparse
import collections
import os
import re

import numpy as np

import bench_cycle
import train_steps

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\(")


def shape_bytes(shape):
  """Bytes of an HLO array shape such as ``f32[1024,1024]{1,0}``."""
  m = re.match(r"(\w+)\[([\d,]*)\]", shape)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  return _DTYPE_BYTES.get(m.group(1), 4) * int(np.prod(dims, dtype=np.int64))


def parse_computations(text):
  """Maps computation name to its instruction lines; also returns the entry."""
  comps, entry, name = {}, None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      name = header.group(2)
      comps[name] = []
      if header.group(1):
        entry = name
    elif line.startswith("}"):
      name = None
    elif name is not None and line.strip():
      comps[name].append(line)
  return comps, entry


def _called(line, key):
  m = re.search(key + r"=\{([^}]*)\}", line)
  if m:
    return [c.strip().lstrip("%") for c in m.group(1).split(",")]
  m = re.search(key + r"=%?([\w.\-]+)", line)
  return [m.group(1)] if m else []


def fused_and_roles(comps, entry):
  """The fused computations, and the role of each called computation."""
  fused, roles = set(), {entry: "entry"}
  n_cond = 0
  for name, lines in comps.items():
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      op = m.group(3)
      if op == "fusion":
        fused.update(_called(line, "calls"))
      elif op == "conditional":
        branches = _called(line, "branch_computations")
        if not branches:
          branches = (_called(line, "false_computation")
                      + _called(line, "true_computation"))
        for j, b in enumerate(branches):
          roles[b] = f"cond{n_cond}.branch{j} (in {roles.get(name, name)})"
        n_cond += 1
      elif op == "while":
        for key in ("body", "condition"):
          for b in _called(line, key):
            roles[b] = f"while.{key} (in {roles.get(name, name)})"
  return fused, roles


def hlo_stats(text):
  """Whole-program counts, and copies per (non-fused) computation.

  Returns a dict with ``copy`` (top-level ``copy(`` instructions, i.e. real
  buffer copies, not copies fused into a loop), ``copy_bytes``,
  ``copy_start``, ``select`` (anywhere, fused or not), ``fusion``,
  ``conditional``, ``while`` and ``per_computation``: for each computation with
  a copy, its role (``entry``, ``cond<i>.branch<j>`` where branch 0 is a
  ``lax.cond``'s false branch, ``while.body``...) with copies and bytes.
  """
  comps, entry = parse_computations(text)
  fused, roles = fused_and_roles(comps, entry)
  stats = collections.Counter()
  per_comp = {}
  for name, lines in comps.items():
    copies, nbytes = 0, 0
    for line in lines:
      m = _INSTR.match(line)
      if not m:
        continue
      op = m.group(3)
      if op in ("fusion", "conditional", "while", "copy-start"):
        stats[op.replace("-", "_")] += 1
      if op == "copy" and name not in fused:
        copies += 1
        nbytes += shape_bytes(m.group(2))
    if copies:
      per_comp[name] = {"role": roles.get(name, "other"), "copies": copies,
                        "bytes": nbytes}
  stats["select"] = len(re.findall(r"\bselect\(", text))
  stats["copy"] = sum(c["copies"] for c in per_comp.values())
  stats["copy_bytes"] = sum(c["bytes"] for c in per_comp.values())
  stats["fused_copy"] = sum(
      1 for name in fused for line in comps.get(name, ())
      if (m := _INSTR.match(line)) and m.group(3) == "copy")
  out = {k: int(stats[k]) for k in ("copy", "copy_bytes", "copy_start",
                                     "select", "fusion", "conditional",
                                     "while", "fused_copy")}
  out["per_computation"] = per_comp
  return out


def format_stats(label, stats):
  lines = [
      f"{label}: copy={stats['copy']} ({stats['copy_bytes'] / 2**20:.1f} MiB)"
      f" copy-start={stats['copy_start']} select={stats['select']}"
      f" fusion={stats['fusion']} conditional={stats['conditional']}"
      f" while={stats['while']}"
  ]
  for name, c in sorted(stats["per_computation"].items(),
                        key=lambda kv: -kv[1]["bytes"]):
    lines.append(f"    {c['copies']:3d} copies, {c['bytes'] / 2**20:7.1f} MiB"
                 f"  in {name} [{c['role']}]")
  return "\n".join(lines)


def compiled_steps(leaves, size, k):
  """``(candidate, kind) -> compiled program``: the programs benchmarks time.

  The train step of benchmarks a and e and the update alone of benchmark b,
  built by ``train_steps``: same donation, same outputs, same order.
  """
  params, grads = train_steps.param_tree(leaves, size)
  out = {}
  for name, tx in bench_cycle.transformations(
      bench_cycle.inner_optimizer("adamw"), k).items():
    out[name, "train step"] = train_steps.Trainer(tx, params, grads).compiled
    out[name, "update only"] = train_steps.UpdateOnly(
        tx, params, grads).compiled
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--leaves", type=int, default=10,
                      help="number of square float32 parameters")
  parser.add_argument("--size", type=int, default=1024,
                      help="side of each parameter")
  parser.add_argument("--k", type=int, default=8,
                      help="micro-steps per optimizer update")
  parser.add_argument("--dump", default=None,
                      help="directory to write the compiled HLO text to")
  args = parser.parse_args(argv)
  print(f"params: {args.leaves} leaves of {args.size}x{args.size} float32, "
        f"inner=adamw, k={args.k}; branch0 of a lax.cond is its false branch\n")
  for (name, kind), compiled in compiled_steps(
      args.leaves, args.size, args.k).items():
    text = compiled.as_text()
    print(format_stats(f"{name} [{kind}]", hlo_stats(text)))
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      fname = re.sub(r"\W+", "_", f"{name}_{kind}") + ".hlo.txt"
      with open(os.path.join(args.dump, fname), "w") as f:
        f.write(text)
    if kind == "update only":
      print()


if __name__ == "__main__":
  main()
