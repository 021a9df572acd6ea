"""The package's imports run downward, with no cycle.

The code map in ``optax_accum/_src/__init__.py`` orders the folders: an
import may stay inside its folder or go to a lower floor, never up, never
sideways between the two entry-point families. A cycle anywhere fails too.
The checks run on a graph; the negative controls give them graphs that
break each rule.
"""

import ast
import pathlib

import pytest

import optax_accum

SRC = pathlib.Path(optax_accum.__file__).parent / "_src"

# Each room's floor: a module may import its own room or a lower floor.
FLOORS = {
    "names": 0,
    "caller_warnings": 0,
    "flax_nnx": 0,
    "keyword_names": 0,
    "tree_match": 0,
    "conditional_loops": 1,
    "validation": 1,
    "mesh": 2,
    "rules": 3,
    "compiled": 3,  # reads compiled programs: never the two families.
    "microbatch": 4,
    "accumulate": 4,
    "planner": 5,
    "proving": 5,
    "nnx_optimizer": 5,  # flax's optimizer around accumulate.
}


def _room(module: str) -> str:
  """``mesh`` for ``mesh.readers``, ``validation`` for ``validation``."""
  return module.split(".")[0]


def _imports_of(path: pathlib.Path) -> set[str]:
  """The ``_src`` modules one file imports, as ``folder.module`` names."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.startswith("optax_accum._src")):
      base = node.module.removeprefix("optax_accum._src").lstrip(".")
      for alias in node.names:
        found.add(f"{base}.{alias.name}" if base else alias.name)
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("optax_accum._src."):
          found.add(alias.name.removeprefix("optax_accum._src."))
  return found


def import_graph() -> dict[str, set[str]]:
  """Each module of ``_src`` and the ``_src`` modules it imports."""
  graph = {}
  for path in SRC.rglob("*.py"):
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
      continue
    graph[".".join(parts)] = _imports_of(path)
  # An import of a name from a module counts as an import of that module.
  return {m: {t if t in graph else t.rpartition(".")[0] for t in targets}
          for m, targets in graph.items()}


def upward_or_sideways(graph: dict[str, set[str]]) -> list[str]:
  """The imports that leave a room for a floor that is not lower."""
  bad = []
  for module, targets in graph.items():
    for target in targets:
      here, there = _room(module), _room(target)
      if here != there and FLOORS[there] >= FLOORS[here]:
        bad.append(f"{module} -> {target}")
  return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle through each module that is on one (depth-first search)."""
  found, done = [], set()

  def visit(module, path):
    if module in path:
      found.append(path[path.index(module):] + [module])
      return
    if module in done:
      return
    for target in sorted(graph.get(module, ())):
      visit(target, path + [module])
    done.add(module)

  for module in sorted(graph):
    visit(module, [])
  return found


def test_every_module_has_a_room():
  graph = import_graph()
  assert len(graph) > 30
  assert {_room(m) for m in graph} == set(FLOORS)


def test_imports_run_down_the_floors():
  assert upward_or_sideways(import_graph()) == []


def test_there_is_no_import_cycle():
  assert cycles(import_graph()) == []


def test_the_public_namespace_reads_only_from_src():
  imported = _imports_of(pathlib.Path(optax_accum.__file__))
  assert imported and all(_room(m) in FLOORS for m in imported)


@pytest.mark.parametrize("graph, rule", [
    ({"mesh.readers": {"rules.token_weighting"},
      "rules.token_weighting": set()}, upward_or_sideways),
    ({"microbatch.loop": {"accumulate.microstep"},
      "accumulate.microstep": set()}, upward_or_sideways),
    ({"rules.a": {"rules.b"}, "rules.b": {"rules.c"},
      "rules.c": {"rules.a"}}, cycles),
])
def test_the_checks_catch_what_they_refuse(graph, rule):
  """Negative controls: an upward, a sideways import, and a cycle."""
  assert rule(graph)
