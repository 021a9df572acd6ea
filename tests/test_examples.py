"""The examples, each in a tiny configuration: they run and show what they say.

``examples/mesh_2d/`` is tested in ``test_distributed.py``, next to the other
sharding tests. The README's code blocks are run here too.
"""

import argparse
import importlib
import pathlib
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

import helpers
import optax_accum as oa

ROOT = pathlib.Path(__file__).parents[1]
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


def test_train_lm_accumulation_follows_the_full_batch_and_naive_does_not(
    tmp_path, capsys):
  train_lm = import_example("train_lm/main")
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
    "scan_train_step", "contrastive/main", "noise_scale/main", "plan"])
def test_help_gives_every_flag_a_help_text_and_its_default(
    script, monkeypatch):
  example = import_example(script)
  parsers = []

  def record(parser, *args, **kwargs):
    del args, kwargs
    parsers.append(parser)
    raise SystemExit(0)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
  with pytest.raises(SystemExit):  # before the example does any work.
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


@pytest.mark.parametrize("example", ["train_lm", "mesh_2d"])
def test_folder_examples_run_as_scripts_from_anywhere(example, tmp_path):
  """``python examples/<example>/main.py`` finds its sibling modules."""
  script = EXAMPLES / example / "main.py"
  done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path,
                        capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr
  assert "(default: " in done.stdout


def test_mesh_2d_labels_each_collective_with_its_mesh_axis():
  collectives = import_example("mesh_2d/main").train.collectives
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  spellings = {  # what XLA prints, and which axis each one means.
      "replica_groups={{0,2,4,6},{1,3,5,7}}": "data",
      "replica_groups=[4,2]<=[8]": "model",
      "replica_groups=[2,4]<=[4,2]T(1,0)": "data",
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}":
          "data",
      "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}":
          "model",
      "replica_groups=mesh['axis_0'=2,'axis_1'=4],"
      " device_ids=([4,2]T(1,0)) {'axis_0'}": "model",
      "replica_groups={}": "data+model",
      "replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}": "no axis",
  }
  for spelling, axis in spellings.items():
    groups = collectives.replica_groups(f" all-reduce(%x), {spelling},", 8)
    assert collectives.axes_of(groups, mesh) == axis, spelling
  assert collectives.replica_groups("source_target_pairs={{0,1}}", 8) is None


def test_batchnorm_linen_group_norm_is_exact_and_batch_norm_trains_as_well():
  batchnorm_linen = import_example("batchnorm_linen")
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
  resume = import_example("resume")
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
  scan_train_step = import_example("scan_train_step")
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


def test_readme_snippets_run_and_print_what_they_say(capsys):
  """The ```python blocks of README.md, in order, in one namespace."""
  namespace = helpers.run_markdown_snippets("README.md", min_blocks=5)
  printed = capsys.readouterr().out.splitlines()
  # Migration, then NNX (nnx.Optimizer.update, then oa.apply_if_updated).
  expected = ["True 1 0", "1 0 True", "4", "2"]
  assert any(printed[i : i + len(expected)] == expected
             for i in range(len(printed))), printed
  # grad_reduction="max", then num_real_microbatches=2.
  assert any(printed[i : i + 2] == ["23.0", "11.0"]
             for i in range(len(printed))), printed
  assert int(namespace["state"].step) == 3  # the linen TrainState recipe


def test_readme_commands_name_scripts_that_exist():
  """Every ``python examples/...`` command of the READMEs names a real file."""
  for readme in (ROOT / "README.md", *EXAMPLES.glob("**/README.md")):
    text = readme.read_text()
    scripts = set(re.findall(r"python3? (examples/\S+\.py)", text))
    assert scripts, readme
    for script in scripts:
      assert (ROOT / script).is_file(), (readme, script)
