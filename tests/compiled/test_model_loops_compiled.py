"""``oa.reduction_overlap`` on ``oa.scan_layers``' step compiled for 8
compile-only H100s and 8 TPU v5e chips.

The step (``tests/support/scan_layers_overlap_worker.py``): the model of
``benchmarks/probe_scanned_layers.py``, smaller, its stacked layers half the
gradient's bytes, under ``oa.value_and_grad(..., overlap_reduction=True)``
in a ``jax.shard_map``. Through ``oa.scan_layers`` its backward loop
all-reduces each layer's slice, asynchronously, beside that layer's input
gradient: the stack's half overlapped, each slice counted once per trip
(8 layers); through ``lax.scan`` (the control) the stack is reduced whole
after the loop, and only the unembedding's quarter is overlapped. The
probe's full size reads the same, 50% against 25%, on both.
Each program is compiled in a child process, with the compiler flags of
``overlap_worker`` (no combining; on TPUs, asynchronous collective
fusions). Skipped, saying why, without libtpu (or, for the H100s, the CUDA
plugin and ptxas).
"""

import json
import subprocess
import sys

import pytest

import helpers
import overlap_worker
from zoo import compile_only as co

WORKER = helpers.SUPPORT / "scan_layers_overlap_worker.py"
LAYERS = 8
pytestmark = pytest.mark.slow


def _child_report(platform: str, **env: str) -> dict:
  done = subprocess.run([sys.executable, str(WORKER), platform],
                        capture_output=True, text=True, check=False,
                        env=helpers.worker_env(**env), timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.splitlines()[-1])


def _assert_the_stack_is_hidden_in_its_loop(report: dict) -> None:
  scanned, control = report["scan_layers"], report["lax.scan"]
  assert scanned["share"] == 0.5, scanned["line"]
  ((nbytes, trips, asynchronous, flops),) = scanned["in_loops"]
  assert trips == LAYERS and asynchronous and flops > 0, scanned
  assert nbytes * trips == scanned["total_bytes"] // 2
  assert "inside a model's loop" in scanned["line"]
  assert "final only when it ends" not in scanned["line"]
  assert control["share"] == 0.25 and control["in_loops"] == [], control
  assert control["total_bytes"] == scanned["total_bytes"]


@pytest.mark.skipif(co.missing_gpu() is not None,
                    reason=co.missing_gpu() or "")
def test_h100_hides_each_layers_reduction_in_the_backward_loop():
  _assert_the_stack_is_hidden_in_its_loop(_child_report(
      "gpu", JAX_PLATFORMS="cpu", XLA_FLAGS=overlap_worker.GPU_OVERLAP_FLAGS))


@pytest.mark.skipif(co.missing_tpu() is not None,
                    reason=co.missing_tpu() or "")
def test_tpu_hides_each_layers_reduction_in_the_backward_loop():
  _assert_the_stack_is_hidden_in_its_loop(_child_report(
      "tpu", LIBTPU_INIT_ARGS=overlap_worker.TPU_OVERLAP_FLAGS))
