"""Test configuration: eight simulated CPU devices for the sharding tests.

The device count is set through ``jax.config``, which overrides whatever
``XLA_FLAGS`` the user has; it must happen before jax initialises its
backends, which pytest guarantees by loading this file before any test module.

Strict dtype promotion is switched on per test around our own code
(``jax.numpy_dtype_promotion("strict")``), not globally: optax's own
optimizers rely on standard promotion.

The tests live in folders (``unit/`` mirrors ``optax_accum/_src``;
``forms/``, ``integration/``, ``docs/``, ``compiled/``); what they share is in
``support/`` (``helpers``, ``trajectories``, the worker scripts), imported by
bare name (``import helpers``), so that folder goes on ``sys.path`` here. The
models and the compile-only devices that the benchmarks use too are in the
top-level ``zoo`` package (``from zoo import typed_model``), found in the
repository root: pytest puts it on ``sys.path`` to load the root conftest.py.
Every test module has its own basename: pytest imports them by it.

Two tiers: ``python -m pytest -q`` leaves out the tests marked
``pytest.mark.slow`` (``addopts`` in pyproject.toml): the examples and
the guides run end to end, several processes, the benchmarks, the programs
compiled for TPU and GPU, and the tests and parametrized variants measured
slowest (about 2 s or more each on 2 CPU cores).
``python -m pytest -q -m slow`` runs those alone, ``-m ""`` both; CI runs
the first in both of its environments and the second once. Both run in two
processes (pytest-xdist, ``-n 2 --dist loadfile`` in ``addopts``: a module's
tests and its module-scoped compilations stay in one process); ``-n 0`` runs
one.
"""

import importlib.util
import pathlib
import sys

import jax
import pytest

NUM_DEVICES = 8
SUPPORT = pathlib.Path(__file__).parent / "support"

jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
if str(SUPPORT) not in sys.path:
  sys.path.insert(0, str(SUPPORT))


def pytest_collection_modifyitems(config, items):
  """Skips the benchmarks' smoke test where optax has no ``microbatching``.

  The benchmarks compare against ``optax.microbatching`` (optax >= 0.2.7),
  while the library itself needs only optax >= 0.2.6, the version that the
  minimum-versions run of ``.ci/run`` pins.
  """
  del config
  if importlib.util.find_spec("optax.microbatching") is not None:
    return
  skip = pytest.mark.skip(reason="optax.microbatching needs optax >= 0.2.7")
  for item in items:
    if item.path.name == "test_benchmarks.py":
      item.add_marker(skip)
