"""The examples, each in a tiny configuration: they run and show what they say.

``examples/mesh_2d.py`` is tested in ``test_distributed.py``, next to the other
sharding tests. The README's code blocks are run here too.
"""

import importlib.util
import pathlib
import re
import types

import jax
import numpy as np

import optax_accum as oa

ROOT = pathlib.Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"


def _load(name: str) -> types.ModuleType:
  """Imports ``examples/<name>.py`` (the examples are scripts, not a package)."""
  spec = importlib.util.spec_from_file_location(
      f"examples_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_train_lm_accumulation_follows_the_full_batch_and_naive_does_not(
    tmp_path, capsys):
  train_lm = _load("train_lm")
  plot_path = tmp_path / "plots" / "lm.png"
  steps = 4
  results = train_lm.main([
      "--steps", str(steps), "--k", "4", "--batch-size", "8",
      "--seq-len", "32", "--dim", "16", "--layers", "1", "--heads", "2",
      "--out", str(plot_path),
  ])

  diffs = results["max_param_diff"]
  assert diffs["accumulate"] < 1e-5, diffs
  assert diffs["naive"] > 1e-3, diffs
  assert diffs["naive"] > 1000 * diffs["accumulate"], diffs
  losses = results["losses"]
  np.testing.assert_allclose(losses["accumulate"], losses["full_batch"],
                             rtol=1e-5)
  assert np.abs(losses["naive"] - losses["full_batch"]).max() > 1e-4
  assert results["optimizer_updates"] == steps
  # Micro-batches sorted by length: uneven token counts are the point.
  tokens = results["microbatch_tokens_mean"]
  assert np.all(np.diff(tokens) >= 0) and tokens[-1] > 2 * tokens[0], tokens

  assert results["plot"] == str(plot_path)
  assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  printed = capsys.readouterr().out
  for label in train_lm.LABELS.values():
    assert label in printed


def test_batchnorm_linen_group_norm_is_exact_and_batch_norm_trains_as_well():
  batchnorm_linen = _load("batchnorm_linen")
  k = 2
  results = batchnorm_linen.main(
      ["--steps", "40", "--k", str(k), "--batch-size", "32", "--quiet"])

  # GroupNorm has no batch dependence: k micro-batches are the full batch.
  assert results["max_param_diff"]["group_norm"] < 1e-5, results
  # BatchNorm normalizes each micro-batch by its own statistics: not exact.
  assert results["max_param_diff"]["batch_norm"] > 1e-3, results
  for name, losses in results["losses"].items():
    assert losses[-5:].mean() < 0.9 * losses[:5].mean(), name
  accuracy = results["accuracy"]
  assert accuracy["batch_norm_k1"] > 0.4, accuracy  # chance: 0.1
  # ... but it trains as well, and its running averages (used at test time)
  # were threaded through the micro-batches.
  assert abs(accuracy[f"batch_norm_k{k}"] - accuracy["batch_norm_k1"]) < 0.05
  assert accuracy[f"group_norm_k{k}"] == accuracy["group_norm_k1"]
  stats = results["batch_stats"][k]["BatchNorm_0"]
  assert np.abs(np.asarray(stats["mean"])).max() > 0.01  # moved from init


def test_resume_mid_cycle_in_a_new_process_is_bit_identical(tmp_path, capsys):
  resume = _load("resume")
  k, save_at, micro_steps = 4, 5, 10
  results = resume.main([
      "--micro-steps", str(micro_steps), "--save-at", str(save_at),
      "--k", str(k), "--dir", str(tmp_path),
  ])

  assert results["saved_micro_step_in_cycle"] == save_at % k != 0
  assert results["bitwise_equal"], results
  assert results["max_abs_diff"] == 0.0
  assert results["optimizer_updates"] == micro_steps // k
  assert (tmp_path / f"step_{save_at}").is_dir()
  assert (tmp_path / "resumed").is_dir()
  assert "bit for bit: True" in capsys.readouterr().out

  # What the new process saved is a whole train state, AccumulateState included.
  restored = resume.restore(tmp_path / "resumed", k)
  state = oa.find_accumulate_state(restored["opt_state"])
  assert int(state.count) == micro_steps // k
  assert int(state.micro_step) == micro_steps % k
  assert int(restored["micro_step"]) == micro_steps


def test_scan_train_step_is_the_full_batch_gradient_and_the_loss_falls():
  scan_train_step = _load("scan_train_step")
  results = scan_train_step.main([])

  assert results["loss_error"] < 1e-5, results["loss_error"]
  assert results["grad_error"] < 1e-5, results["grad_error"]
  losses = results["losses"]
  assert losses[-1] < 1e-3 * losses[0], (losses[0], losses[-1])
  assert all(np.isfinite(losses))
  # The test is not vacuous: the micro-batches' real rows are uneven, so the
  # mean of per-micro-batch means is not the full batch's loss.
  batch = scan_train_step.example_batch()
  params = scan_train_step.initial_params()
  microbatches = [jax.tree.map(lambda a, i=i: a[16 * i : 16 * (i + 1)], batch)
                  for i in range(4)]
  mean_of_means = np.mean([float(scan_train_step.loss_fn(params, mb))
                           for mb in microbatches])
  full = float(scan_train_step.loss_fn(params, batch))
  assert abs(mean_of_means - full) > 1e-2 * full


def test_readme_snippets_run_and_print_what_they_say(capsys):
  """The ```python blocks of README.md, in order, in one namespace."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
  assert len(blocks) >= 5
  namespace = {}
  for block in blocks:
    exec(block, namespace)  # pylint: disable=exec-used
  printed = capsys.readouterr().out.splitlines()
  expected = ["True 1 0", "1 0 True", "4"]  # migration, then NNX
  assert any(printed[i : i + len(expected)] == expected
             for i in range(len(printed))), printed
  assert int(namespace["state"].step) == 3  # the linen TrainState recipe
