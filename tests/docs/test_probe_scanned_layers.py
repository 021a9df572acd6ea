"""The scanned-layers probe (benchmarks/probe_scanned_layers.py): its
per-layer reduction inside the backward loop, hand-written and the
library's (``oa.scan_layers`` in ``oa.value_and_grad``), gives the full
batch's gradient, as its results file says."""

import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parents[2] / "benchmarks"


@pytest.mark.slow
def test_the_per_layer_reduction_is_the_full_batch_gradient():
  sys.path.insert(0, str(BENCHMARKS))
  try:
    probe = importlib.import_module("probe_scanned_layers")
    got = probe.exactness()
  finally:
    # The benchmarks' bare module names (``report``) leave with their
    # folder, so that no example meets them.
    sys.path.remove(str(BENCHMARKS))
    for name in [p.stem for p in BENCHMARKS.glob("*.py")]:
      sys.modules.pop(name, None)
  largest = got["full batch, largest |g|"]
  for variant in ("plain", "in loop", "library", "library, lax.scan"):
    for leaf, error in got[variant].items():
      # float32 sums of 256 rows in another order: a few ulps of the
      # largest entry. A reduction left out or doubled is off by O(1).
      assert error <= 1e-5 * largest[leaf], (variant, leaf, error)
  assert got["in loop"]["layers"] <= 2 * got["plain"]["layers"] + 1e-6
  assert got["library"]["layers"] <= (
      2 * got["library, lax.scan"]["layers"] + 1e-6)
