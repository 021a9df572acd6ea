"""examples/fsdp_tensor/ in a small configuration: it shows what it says.

A Flax NNX transformer with logical axis rules on a data x fsdp x tensor mesh
(Explicit axes), dropout and a token-weighted loss: the accumulated gradient
equals one device's full-batch gradient and is sharded like the parameters,
and no collective over a data axis runs inside the micro-batch loop.
"""

import helpers

_SMALL = ["--k", "2", "--steps", "2", "--batch", "16", "--seq-len", "16",
          "--dim", "32", "--layers", "1"]


def test_fsdp_tensor_example_is_exact_and_reduces_over_data_after_the_loop(
    capsys):
  results = helpers.import_example("fsdp_tensor/main").main(_SMALL)
  assert results["loss_diff"] < 1e-5, results["loss_diff"]
  assert results["grad_max_abs_diff"] < 1e-5, results["grad_max_abs_diff"]
  assert results["grads_sharded_like_params"]
  assert "P('tensor', 'fsdp')" in results["grad_specs"]  # FSDP x tensor.
  assert results["losses"][-1] < results["losses"][0]

  by_axes = results["collectives"].by_axes
  for axes, counts in by_axes.items():
    if "data" in axes or "fsdp" in axes:  # gathered before, reduced after.
      assert counts.in_loop == {}, (axes, counts)
  assert by_axes[("fsdp",)].outside["all-gather"] > 0  # the FSDP gather.
  assert by_axes[("fsdp",)].outside["reduce-scatter"] > 0
  assert by_axes[("data", "fsdp")].outside == {"all-reduce": 1}
  assert by_axes[("tensor",)].in_loop["all-reduce"] > 0  # the model's own.
  printed = capsys.readouterr().out
  assert "data+fsdp         none" in printed, printed


def test_fsdp_tensor_flags_have_help_and_defaults(monkeypatch):
  helpers.assert_flags_have_help_and_defaults("fsdp_tensor/main", monkeypatch)
