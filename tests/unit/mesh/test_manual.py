"""``manual``: the one door to ``jax.shard_map``, as the code map says.

A change of ``jax.shard_map``'s signature then touches one module. The check
reads the source (calls, not docstrings: the doctests may call it); its
negative control gives it a module that calls it directly.
"""

import ast
import pathlib

import optax_accum

SRC = pathlib.Path(optax_accum.__file__).parent / "_src"


def calls_shard_map(source: str) -> bool:
  """Whether ``source`` calls ``jax.shard_map`` or imports it by name."""
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module in (
        "jax", "jax.experimental.shard_map"):
      if any(alias.name == "shard_map" for alias in node.names):
        return True
    if (isinstance(node, ast.Attribute) and node.attr == "shard_map"
        and isinstance(node.value, ast.Name) and node.value.id == "jax"):
      return True
  return False


def test_only_manual_enters_shard_map():
  callers = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
                   if calls_shard_map(path.read_text()))
  assert callers == ["mesh/manual.py"]


def test_the_check_catches_a_direct_call():
  """Negative controls: a call, an import by name; a docstring is not."""
  assert calls_shard_map("import jax\nf = jax.shard_map(g, mesh=m)\n")
  assert calls_shard_map("from jax import shard_map\n")
  assert not calls_shard_map('"""jax.shard_map(f, mesh=mesh)"""\n')
  assert not calls_shard_map("from optax_accum._src.mesh import manual\n"
                             "manual.shard_map(f, in_specs=P())\n")
