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
On the decoder of ``zoo/typed_model.py`` (``overlap_worker.DECODER``),
its layers unrolled: every leaf but the embedding and the unembedding can
overlap, and does; with its layers stacked and scanned (``scan_layers``),
the stacked leaves' gradients are complete only when the backward's loop
over the layers ends, and little is hidden.
Each TPU program with flags of its own is compiled in a child process:
libtpu reads ``LIBTPU_INIT_ARGS`` once, when it loads. Skipped, saying
why, without libtpu (or, for the H100s, the CUDA plugin and ptxas).
"""

import json
import subprocess
import sys

import jax
import pytest

import helpers
import optax_accum as oa
import overlap_worker
from zoo import compile_only as co
from zoo import typed_model as tm

WORKER = helpers.SUPPORT / "overlap_worker.py"
_NEEDS_TPU = pytest.mark.skipif(co.missing_tpu() is not None,
                                reason=co.missing_tpu() or "")
_NEEDS_GPU = pytest.mark.skipif(co.missing_gpu() is not None,
                                reason=co.missing_gpu() or "")
pytestmark = pytest.mark.slow


def _child_report(platform: str, *mode: str, **env: str) -> dict:
  done = subprocess.run([sys.executable, str(WORKER), platform, *mode],
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


def _decoder_bytes() -> dict:
  """The decoder's gradient bytes: in all, in the embedding and the
  unembedding (computed after the backward's last matrix multiply, or as
  its last one), and outside the layers."""
  cfg = overlap_worker.DECODER
  shapes = jax.eval_shape(lambda: tm.init(cfg))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize
                            for x in jax.tree.leaves(tree))
  return {"all": nbytes(shapes),
          "ends": nbytes((shapes["embed"], shapes["unembed"])),
          "outside layers": nbytes(shapes) - nbytes(shapes["layers"])}


def _assert_decoder_overlaps(report: dict) -> None:
  """Unrolled: at least every leaf's bytes but the embedding's and the
  unembedding's overlapped (less 1% for a few norms' reductions issued
  synchronously). Scanned: at most the leaves outside the layers."""
  size = _decoder_bytes()
  unrolled, scanned = report["unrolled"], report["scanned"]
  assert unrolled["share"] >= (
      1 - size["ends"] / size["all"] - 0.01), unrolled["line"]
  assert report["unrolled, loop whole"]["share"] == 0.0
  # The gap left: a stacked leaf's gradient is whole only when the
  # backward's loop over the layers ends, so its reduction cannot start
  # beside that backward (a few start beside matrix multiplies XLA left
  # after that loop); the peel hides the leaves outside the layers at most.
  assert scanned["share"] <= size["outside layers"] / size["all"], (
      scanned["line"])
  assert scanned["share"] < unrolled["share"] / 2, scanned["line"]


@_NEEDS_TPU
def test_tpu_decoder_overlaps_all_but_its_ends_unrolled_not_scanned():
  """TPU v5e with the flags: 60.2% of the unrolled decoder's bytes, the
  embedding's and unembedding's not (39.7%); scanned, 11.2%. The peak
  is not the loop's: XLA's asynchronous all-reduce fusions hold 74.4
  against 55.0 MiB, under two gradients (10.1 MiB) more."""
  report = _child_report(
      "tpu", "decoder", LIBTPU_INIT_ARGS=overlap_worker.TPU_OVERLAP_FLAGS)
  _assert_decoder_overlaps(report)
  assert report["unrolled"]["peak_bytes"] <= (
      report["unrolled, loop whole"]["peak_bytes"]
      + 2 * _decoder_bytes()["all"]), report


@_NEEDS_GPU
def test_h100_decoder_overlaps_all_but_its_ends_unrolled_not_scanned():
  """8 H100s, no combining: 80.1% of the unrolled decoder's bytes (one of
  its two ends too: only one 2 MiB leaf's reduction starts after the last
  matrix multiply), at the loop's peak; scanned, 4.4%."""
  report = _child_report(
      "gpu", "decoder", JAX_PLATFORMS="cpu",
      XLA_FLAGS=overlap_worker.GPU_OVERLAP_FLAGS)
  _assert_decoder_overlaps(report)
  assert report["unrolled"]["peak_bytes"] <= 1.01 * report[
      "unrolled, loop whole"]["peak_bytes"], report
