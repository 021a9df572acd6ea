"""The examples, each in a tiny configuration: they run and show what they say.

``examples/mesh_2d/`` is tested in ``test_distributed.py``, next to the other
sharding tests. The README's code blocks are run here too.
"""

import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import helpers
import optax_accum as oa

ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.slow
def test_train_lm_accumulation_follows_the_full_batch_and_naive_does_not(
    tmp_path, capsys):
  train_lm = helpers.import_example("train_lm/main")
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
  assert printed.startswith("Compiling the train steps")
  for label in train_lm.train.LABELS.values():
    assert label in printed


@pytest.mark.parametrize("script", [
    "train_lm/main", "mesh_2d/main", "batchnorm_linen", "resume",
    "scan_train_step", "contrastive/main", "noise_scale/main", "plan",
    "no_sync", "rl_token_level/main"])
def test_help_gives_every_flag_a_help_text_and_its_default(
    script, monkeypatch):
  helpers.assert_flags_have_help_and_defaults(script, monkeypatch)


@pytest.mark.parametrize("example", ["train_lm", "mesh_2d", "rl_token_level"])
@pytest.mark.slow
def test_folder_examples_run_as_scripts_from_anywhere(example, tmp_path):
  """``python examples/<example>/main.py`` finds its sibling modules."""
  script = EXAMPLES / example / "main.py"
  done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr
  assert "(default: " in done.stdout


@pytest.mark.slow
def test_batchnorm_linen_group_norm_is_exact_and_batch_norm_trains_as_well():
  batchnorm_linen = helpers.import_example("batchnorm_linen")
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


@pytest.mark.slow
def test_resume_mid_cycle_in_a_new_process_is_bit_identical(tmp_path, capsys):
  resume = helpers.import_example("resume")
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


@pytest.mark.slow
def test_scan_train_step_is_the_full_batch_gradient_and_the_loss_falls():
  scan_train_step = helpers.import_example("scan_train_step")
  results = scan_train_step.main([])

  assert results["loss_error"] < 1e-5, results["loss_error"]
  assert results["grad_error"] < 1e-5, results["grad_error"]
  assert results["accuracy_error"] < 1e-6, results["accuracy_error"]
  losses = results["losses"]
  assert all(np.isfinite(losses))
  # Trained with dropout (a key per micro-batch), evaluated without it.
  assert results["eval_loss"] < 1e-2 * losses[0], (losses[0], results)
  assert results["accuracy"] > 0.9 > results["initial_accuracy"], results
  # The test is not vacuous: the micro-batches' real rows are uneven, so the
  # mean of per-micro-batch means is neither the full batch's loss nor its
  # accuracy.
  batch = scan_train_step.example_batch()
  params = scan_train_step.initial_params()
  microbatches = [jax.tree.map(lambda a, i=i: a[16 * i : 16 * (i + 1)], batch)
                  for i in range(4)]
  for metric in (scan_train_step.loss_fn, scan_train_step.accuracy):
    mean_of_means = np.mean([float(metric(params, mb)) for mb in microbatches])
    full = float(metric(params, batch))
    assert abs(mean_of_means - full) > 1e-2 * full, metric


@pytest.mark.slow
def test_no_sync_reduces_once_per_update_and_is_the_full_batch_step(capsys):
  results = helpers.import_example("no_sync").main(["--k", "4", "--rows", "16"])
  assert results["jax.grad"]["reductions"] == 4  # the naive loop: k.
  assert results["deferred"]["reductions"] == 1
  for r in results.values():
    assert r["error"] < 1e-6, results
  assert "1 gradient all-reduce(s) per update" in capsys.readouterr().out


@pytest.mark.slow
def test_rl_token_level_sum_losses_are_the_full_batch_and_naive_is_not(
    capsys):
  """GRPO/DAPO token-level normalisation over micro-batches of uneven lengths.

  Each micro-batch's loss is the sum of its tokens' terms, accumulated with
  ``loss_reduction="sum"`` and ``num_tokens``: the full batch's step. The
  negative control: each micro-batch's mean, averaged over k, is not.
  """
  example = helpers.import_example("rl_token_level/main")
  results = example.main(["--prompts", "4", "--group", "4", "--max-len", "32",
                          "--k", "4", "--steps", "2"])

  for name in ("accumulate", "one_call"):
    assert results["grad_error"][name] < 1e-5, results
    assert results["param_error"][name] < 1e-5, results
    np.testing.assert_allclose(results["loss"][name],
                               results["loss"]["full_batch"], rtol=1e-5)
  assert results["exact"]
  assert results["grad_error"]["naive"] > 0.05, results
  assert results["param_error"]["naive"] > 1e-2, results
  assert abs(results["loss"]["naive"] - results["loss"]["full_batch"]) > 1e-4
  # The micro-batches' completion tokens are very uneven: the point.
  tokens = results["microbatch_tokens"]
  assert np.all(np.diff(tokens) > 0) and tokens[-1] > 3 * tokens[0], tokens
  assert "take the full batch's step: True" in capsys.readouterr().out


def test_readme_snippets_run():
  """The ```python blocks of README.md (the tour), in order, in one namespace.

  The guides' blocks run in tests/docs/test_docs.py.
  """
  namespace = helpers.run_markdown_snippets("README.md", min_blocks=2)
  assert callable(namespace["train_step"]), sorted(namespace)


def test_readme_commands_name_scripts_that_exist():
  """Every ``python examples/...`` command of the READMEs names a real file."""
  for readme in (ROOT / "README.md", *EXAMPLES.glob("**/README.md")):
    text = readme.read_text()
    scripts = set(re.findall(r"python3? (examples/\S+\.py)", text))
    assert scripts, readme
    for script in scripts:
      assert (ROOT / script).is_file(), (readme, script)


@pytest.mark.slow
def test_train_lm_plot_draws_the_accumulated_gap_above_the_zero_line(
    tmp_path, monkeypatch):
  """(b)'s gap to (a) is zero to rounding: the zero line must not hide it."""
  report = helpers.import_example("train_lm/report")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)
  steps = 20
  ramp = np.linspace(3.0, 2.0, steps)
  results = {"steps": steps, "k": 4,
             "losses": {"full_batch": ramp, "accumulate": ramp + 1e-7,
                        "naive": ramp + 0.05},
             "param_diffs": {"accumulate": np.full(steps, 1e-7),
                             "naive": np.full(steps, 1e-2)}}
  report.plot(results, batch_size=8, out=str(tmp_path / "lm.png"))
  (figure,) = figures
  middle = figure.axes[1]
  (zero,) = [line for line in middle.lines
             if np.all(np.asarray(line.get_ydata()) == 0)]
  (accumulated,) = [line for line in middle.lines
                    if line.get_label() == report.LABELS["accumulate"]]
  assert accumulated.get_zorder() > zero.get_zorder()
  assert all(accumulated.get_zorder() >= line.get_zorder()
             for line in middle.lines)
  assert zero.get_linewidth() < accumulated.get_linewidth()
  assert zero.get_linestyle() != "-"
