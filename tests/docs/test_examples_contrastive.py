"""examples/contrastive/ in a tiny configuration: it shows what it says."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

FOLDER = pathlib.Path(__file__).parents[2] / "examples" / "contrastive"


def _load_main():
  """Imports examples/contrastive/main.py with its folder on the path."""
  sys.path.insert(0, str(FOLDER))
  try:
    spec = importlib.util.spec_from_file_location("contrastive_main",
                                                  FOLDER / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(FOLDER))
  return module


def test_coupled_follows_the_full_batch_and_naive_does_not(tmp_path, capsys):
  plot_path = tmp_path / "contrastive.png"
  steps = 6
  results = _load_main().main([
      "--steps", str(steps), "--batch-size", "64", "--k", "8",
      "--hidden", "32", "--dim", "8", "--held-out", "64", "--eval-every", "3",
      "--lr", "1e-2", "--out", str(plot_path),
  ])

  diffs = results["max_param_diff"]
  assert diffs["coupled"] < 1e-5, diffs
  assert diffs["naive"] > 1e-3, diffs
  losses = results["losses"]
  np.testing.assert_allclose(losses["coupled"], losses["full_batch"],
                             rtol=1e-5)
  assert np.abs(losses["naive"] - losses["full_batch"]).max() > 1e-3
  accuracy = results["accuracies"]
  np.testing.assert_allclose(accuracy["coupled"], accuracy["full_batch"])
  assert list(results["eval_steps"]) == [3, 6]
  assert plot_path.stat().st_size > 10_000
  out = capsys.readouterr().out
  assert "(b) oa.coupled_value_and_grad" in out and "held-out top-1" in out
