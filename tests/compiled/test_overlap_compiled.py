"""SPEC 13 (issue 51): ``oa.reduction_overlap`` on programs compiled for 8
compile-only TPU v5e chips and 8 H100s.

The program (``tests/support/overlap_worker.py``): a 4-layer MLP of
f32[256, 256] weights, data parallel in a ``shard_map``, k = 4 micro-batches
in a ``lax.scan`` and one ``psum`` per leaf after it (the hand-written scan),
against the same with the last micro-batch taken out of the scan. XLA can
start a leaf's reduction during the last backward only in the second, and
only if it issues the reduction asynchronously and does not combine the
leaves' reductions into one. And ``oa.value_and_grad(...,
overlap_reduction=True)`` of an 8-layer MLP in the typed and the
``shard_map`` forms, which takes its last micro-batch out of the loop: on
the H100s 7 of 8 leaves' bytes (87.5%, SPEC 13's >= 80%), on TPU v5e with
the flags 5 of 8, with libtpu's defaults none; its step still passes
``oa.check_train_step`` (the loop and the last micro-batch after it), and
on the H100s its peak memory is the loop's (a zero selected after the
reduction once held a zeroed copy of the gradient through the whole
program: 5.62 against 5.41 MB here, 1B: +10% to +16%). Not so on TPU v5e
at this size: its asynchronous collective fusions add about 33 MB to the
hand-written peeled scan and to ours alike (41.1 against 7.8 MB).
Each TPU program with flags of its own is compiled in a child process:
libtpu reads ``LIBTPU_INIT_ARGS`` once, when it loads. Skipped, saying
why, without libtpu (or, for the H100s, the CUDA plugin and ptxas).
"""

import json
import subprocess
import sys

import pytest

import helpers
import optax_accum as oa
import overlap_worker
from zoo import compile_only as co

WORKER = helpers.SUPPORT / "overlap_worker.py"
_NEEDS_TPU = pytest.mark.skipif(co.missing_tpu() is not None,
                                reason=co.missing_tpu() or "")
_NEEDS_GPU = pytest.mark.skipif(co.missing_gpu() is not None,
                                reason=co.missing_gpu() or "")
pytestmark = pytest.mark.slow


def _child_report(platform: str, **env: str) -> dict:
  done = subprocess.run([sys.executable, str(WORKER), platform],
                        capture_output=True, text=True, check=False,
                        env=helpers.worker_env(**env), timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.splitlines()[-1])


def _assert_peeled_overlaps(report: dict) -> None:
  """The scan's reductions all after its loop; the peeled step's, but the
  first layer's (its gradient is the backward's last), started before the
  last matrix multiply, asynchronous, each beside a matrix multiply;
  oa.count_collectives counts each once."""
  assert report["scan"]["share"] == 0.0, report["scan"]
  for variant in ("scan", "peeled"):  # one per leaf, none combined.
    assert report[variant]["all_reduces"] == overlap_worker.LAYERS, report
  peeled = report["peeled"]
  assert len(peeled["reductions"]) == overlap_worker.LAYERS, peeled
  assert peeled["share"] == pytest.approx(
      (overlap_worker.LAYERS - 1) / overlap_worker.LAYERS), peeled
  overlapped = [r for r in peeled["reductions"] if r[1] and r[2]]
  assert overlapped and all(flops > 0 for *_, flops in overlapped), peeled


def _assert_value_and_grad_overlaps(report: dict, overlapped: int) -> None:
  """``overlapped`` of the 8 leaves' reductions start before the last
  matrix multiply (H100: 7, all but the first layer's; TPU v5e: 5, XLA's
  TPU scheduler keeping the other two after it at this size)."""
  layers = overlap_worker.OA_LAYERS
  for form in ("typed", "shard_map"):
    got = report[f"oa {form}"]
    assert got["share"] == pytest.approx(overlapped / layers), (form, got)
    assert got["all_reduces"] == layers, (form, got)  # one per leaf, once.
    assert got["check"] == "ok", (form, got)


@_NEEDS_TPU
def test_tpu_default_flags_overlap_nothing_even_with_the_last_out():
  """Without the flags the last micro-batch leaves the loop for nothing:
  libtpu combines the reductions into one synchronous all-reduce."""
  for form in ("typed", "shard_map"):
    compiled = overlap_worker.compile_value_and_grad(co.tpu_devices(), form)
    assert oa.reduction_overlap(compiled).overlapped_share == 0.0
    assert "optax_accum_last_microbatch" in compiled.as_text()
    oa.check_train_step(compiled, num_microbatches=overlap_worker.K)


@_NEEDS_TPU
def test_tpu_default_flags_reduce_after_the_last_matmul():
  """libtpu's defaults combine the leaves' all-reduces into one synchronous
  all-reduce after the last matrix multiply, scan or not."""
  for peeled in (False, True):
    compiled = overlap_worker.compile_mlp(co.tpu_devices(), peeled)
    report = oa.reduction_overlap(compiled)
    assert report == oa.reduction_overlap(compiled.as_text())
    assert report.overlapped_share == 0.0, (peeled, str(report))
    assert not any(r.asynchronous for r in report.reductions), str(report)


@_NEEDS_TPU
def test_tpu_async_collective_fusion_overlaps_the_peeled_reduction():
  """With XLA TPU's asynchronous all-reduce fusions and no combining
  (overlap_worker.TPU_OVERLAP_FLAGS), 3 of the 4 leaves' reductions start
  before the last backward's last matrix multiply."""
  report = _child_report(
      "tpu", LIBTPU_INIT_ARGS=overlap_worker.TPU_OVERLAP_FLAGS)
  _assert_peeled_overlaps(report)
  _assert_value_and_grad_overlaps(report, overlapped=5)


@_NEEDS_GPU
def test_h100_overlaps_the_peeled_reduction_without_combining():
  """XLA's GPU compiler issues all-reduce-start/done; without combining
  (at these sizes its combiner merges the 4 leaves into one), the peeled
  step's start before the last matrix multiply."""
  report = _child_report(
      "gpu", JAX_PLATFORMS="cpu", XLA_FLAGS=overlap_worker.GPU_OVERLAP_FLAGS)
  _assert_peeled_overlaps(report)
  _assert_value_and_grad_overlaps(report, overlapped=7)  # SPEC 13: >= 80%.
  # The peak against the loop kept whole: within 1% (SPEC 13) in the
  # shard_map form. Not in the typed form since its loop kept whole divides
  # each device's partial sum before the reduction (loop.divides_first): its
  # peak fell from 5.41 to 4.39 MB, the peeled step's stayed at 5.31 MB
  # (divided first or not), so the peel holds under one gradient (8 x 256
  # KiB) more.
  gradient_bytes = overlap_worker.OA_LAYERS * overlap_worker.DIM**2 * 4
  for form, extra in (("typed", gradient_bytes), ("shard_map", 0)):
    kept = report[f"oa {form}, loop whole"]
    assert kept["share"] == 0.0, (form, kept)
    assert report[f"oa {form}"]["peak_bytes"] <= (
        1.01 * kept["peak_bytes"] + extra), (
            form, report[f"oa {form}"]["peak_bytes"], kept["peak_bytes"])
