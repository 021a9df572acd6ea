"""examples/fsdp_tensor/ in a small configuration: it shows what it says.

A Flax NNX transformer written for jax.jit (activations annotated with the
batch axes, nnx.Embed(out_sharding=), integer labels) on a data x fsdp x
tensor mesh (Explicit axes), dropout and a token-weighted loss: the
accumulated gradient equals one device's full-batch gradient and is sharded
like the parameters; over the data axes only the leaves that JAX cannot type
reduced (LayerNorms, a bias, the positions) are reduced inside the loop, and
nothing is gathered over "tensor" beyond the full-batch step's.
"""

import pytest

import helpers

_SMALL = ["--k", "2", "--steps", "2", "--batch", "16", "--seq-len", "16",
          "--dim", "32", "--layers", "1"]


@pytest.mark.slow
def test_fsdp_tensor_example_is_exact_and_reduces_over_data_after_the_loop(
    capsys):
  results = helpers.import_example("fsdp_tensor/main").main(_SMALL)
  assert results["loss_diff"] < 1e-5, results["loss_diff"]
  assert results["grad_max_abs_diff"] < 1e-5, results["grad_max_abs_diff"]
  assert results["grads_sharded_like_params"]
  assert "P('tensor', 'fsdp')" in results["grad_specs"]  # FSDP x tensor.
  assert results["losses"][-1] < results["losses"][0]

  by_axes = results["collectives"].by_axes
  full = results["full_batch_collectives"].by_axes
  assert by_axes[("fsdp",)].in_loop == {}  # gathered once, before the loop.
  assert by_axes[("fsdp",)].outside["all-gather"] > 0
  # FSDP gradients reduce-scattered over "fsdp", then summed over "data".
  assert by_axes[("fsdp",)].outside["reduce-scatter"] > 0
  assert by_axes[("data",)].outside == {"all-reduce": 1}
  assert by_axes[("data", "fsdp")].outside == {}
  # Nothing gathered over "tensor" beyond the full-batch step's.
  assert by_axes[("tensor",)].total.get("all-gather", 0) <= full[
      ("tensor",)].total.get("all-gather", 0)
  assert by_axes[("tensor",)].in_loop["all-reduce"] > 0  # the model's own.
  report = results["report"]
  assert "params['positions'].value" in report.fallback_leaves
  assert not any("kernel" in leaf or "embedding" in leaf
                 for leaf in report.fallback_leaves), report
  assert report.fallback_share < 0.1
  printed = capsys.readouterr().out
  assert "Kept replicated, reduced in each micro-batch" in printed, printed


def test_fsdp_tensor_flags_have_help_and_defaults(monkeypatch):
  helpers.assert_flags_have_help_and_defaults("fsdp_tensor/main", monkeypatch)
