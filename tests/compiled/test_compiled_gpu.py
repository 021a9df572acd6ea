"""SPEC 11 on 8 H100s: programs compiled for compile-only GPUs, read.

Needs the CUDA plugin and ptxas (``pip install 'optax-accum[gpu]'``, about
1.2 GB; CI does not install it); skipped, saying so, without them. The
plugin offers compile-only GPUs only to a process that starts jax on the
CPU platform, so the programs are compiled and read in one child process
(``tests/support/compiled_gpu_worker.py``) and its report is checked here.
The H100 target config is ``zoo/data/h100_sxm.txtpb`` (from XLA's
repository).
"""

import json
import subprocess
import sys

import pytest

import helpers
from zoo import compile_only as co

pytestmark = pytest.mark.skipif(co.missing_gpu() is not None,
                                reason=co.missing_gpu() or "")

WORKER = helpers.SUPPORT / "compiled_gpu_worker.py"


@pytest.fixture(scope="module")
def report():
  done = subprocess.run([sys.executable, str(WORKER)],
                        capture_output=True, text=True, check=False,
                        env=helpers.worker_env(JAX_PLATFORMS="cpu"),
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.splitlines()[-1])


def test_count_collectives_reads_the_compile_only_executable(report):
  assert "H100" in report["device_kind"]
  for name in ("data x tensor", "fsdp"):
    assert report[name]["same_counts"], name


def test_include_scalars_false_leaves_out_the_combined_scalars(report):
  """XLA's GPU combiner concatenates the loss and token count: scalars."""
  m = report["data x tensor"]
  assert m["combined_scalars"] >= 1
  assert m["small_unscalar"] == []


def test_typed_form_reduces_no_gradient_over_data_in_the_loop(report):
  m = report["data x tensor"]
  in_loop = [r for r in m["reductions"] if r[2]]
  assert sum(r[1] for r in in_loop) <= m["pos_bytes"], in_loop
  assert [r for r in m["reductions"] if not r[2]]


def test_fsdp_gradients_leave_the_loop_as_reduce_scatters(report):
  """XLA's GPU compiler forms them from the typed form's all-reduce + slice."""
  m = report["fsdp"]
  assert not [r for r in m["reductions"] if r[2]]  # none in the loop.
  assert "reduce-scatter" in {r[0] for r in m["reductions"]}
  # All-reduced: only the parameters that are not sharded over fsdp.
  all_reduced = sum(r[1] for r in m["reductions"] if r[0] == "all-reduce")
  assert all_reduced <= m["replicated_bytes"], m
