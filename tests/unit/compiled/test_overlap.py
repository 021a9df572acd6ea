"""``oa.reduction_overlap`` on hand-written scheduled HLO, in each of the
forms XLA prints: synchronous, GPU's start and done (``is_sync`` too),
``async-start`` around a reduce-scatter, XLA TPU's asynchronous collective
fusions (tied by ``chain_id``). Compiled programs: tests/compiled/."""

import jax
import pytest

import optax_accum as oa
from optax_accum._src.compiled import hlo

_ADD = """\
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""
# Two matrix multiplies of the backward, 2 * 8 * 64 * 64 flops each.
_DOT_FLOPS = 2 * 8 * 64 * 64


_PARAMETERS = """\
  %w = f32[64,64] parameter(0)
  %v = f32[32,64] parameter(1)
  %x = f32[8,64] parameter(2)
"""


def _module(entry: str, computations: str = "", scheduled=True) -> str:
  header = "HloModule m" + (", is_scheduled=true" if scheduled else "")
  return (f"{header}\n\n{_ADD}{computations}\n"
          "ENTRY %main (w: f32[64,64], v: f32[32,64], x: f32[8,64])"
          f" -> f32[64,64] {{\n{_PARAMETERS}{entry}}}\n")


_DOTS = """\
  %d1 = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %d2 = f32[8,64] dot(%d1, %w), lhs_contracting_dims={1}
"""


def test_a_synchronous_reduction_after_the_last_dot_is_not_overlapped():
  report = oa.reduction_overlap(_module(_DOTS + """\
  ROOT %ar = f32[64,64] all-reduce(%w), replica_groups={}
"""))
  assert report.overlapped_share == 0.0 and report.num_reductions == 1
  (reduction,) = report.reductions
  assert reduction == (
      "ar", "all-reduce", 64 * 64 * 4, False, False, 0, 0)
  assert not reduction.overlapped
  assert "0.0% of 0.02 MiB" in str(report)


def test_an_asynchronous_start_before_the_last_dot_is_overlapped():
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
""" + _DOTS + """\
  ROOT %done = f32[64,64] all-reduce-done(%start)
"""))
  assert report.overlapped_share == 1.0
  (reduction,) = report.reductions
  assert reduction.asynchronous and reduction.starts_before_last_matmul
  assert reduction.flops_between == 2 * _DOT_FLOPS


def test_the_share_counts_bytes():
  """Overlapped: f32[64,64] of f32[64,64] + f32[32,64]: two thirds."""
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
  %d1 = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %done = f32[64,64] all-reduce-done(%start)
  %d2 = f32[8,64] dot(%d1, %w), lhs_contracting_dims={1}
  ROOT %ar = f32[32,64] all-reduce(%v), replica_groups={}
"""))
  assert report.num_reductions == 2
  assert report.overlapped_bytes == 64 * 64 * 4
  assert report.total_bytes == 64 * 64 * 4 + 32 * 64 * 4
  assert report.overlapped_share == pytest.approx(2 / 3)
  # Only the dot between its start and its done.
  assert [r.flops_between for r in report.reductions] == [_DOT_FLOPS, 0]


def test_a_start_that_xla_marks_synchronous_is_not_asynchronous():
  """XLA's GPU compiler keeps the start/done pair but runs it in sync."""
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}, """
      """backend_config={"collective_backend_config":{"is_sync":true}}
""" + _DOTS + """\
  ROOT %done = f32[64,64] all-reduce-done(%start)
"""))
  assert report.overlapped_share == 0.0
  assert not report.reductions[0].asynchronous


def test_an_async_start_around_a_reduce_scatter_and_its_updates():
  """GPU's reduce-scatter: its bytes are the shard's, as count_collectives
  counts them; async-update continues it."""
  wrapped = """\
%scatter (p: f32[64,64]) -> f32[8,64] {
  %p = f32[64,64] parameter(0)
  ROOT %rs = f32[8,64] reduce-scatter(%p), replica_groups={}, dimensions={0}
}
"""
  text = _module("""\
  %d0 = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %start = ((f32[64,64]), f32[8,64]) async-start(%w), calls=%scatter
  %d1 = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %update = ((f32[64,64]), f32[8,64]) async-update(%start)
  %d2 = f32[8,64] dot(%d1, %w), lhs_contracting_dims={1}
  %done = f32[8,64] async-done(%update)
  ROOT %d3 = f32[8,64] dot(%d2, %w), lhs_contracting_dims={1}
""", wrapped)
  (reduction,) = oa.reduction_overlap(text).reductions
  assert reduction.collective == "reduce-scatter"
  assert reduction.nbytes == 8 * 64 * 4
  assert [c.nbytes for c in hlo.collectives(text)] == [reduction.nbytes]
  assert reduction.overlapped and reduction.flops_between == 2 * _DOT_FLOPS


def test_a_reduce_scatter_that_names_the_fusion_emitter_is_one():
  """XLA's TPU compiler (libtpu 0.0.42.1, FSDP) writes some reduce-scatters
  as the instruction itself, its backend config naming the emitter of its
  reduce-scatter fusion."""
  report = oa.reduction_overlap(_module(_DOTS + """\
  ROOT %rs = f32[8,64] reduce-scatter(%w), replica_groups={}, \
dimensions={0}, backend_config={"collective_algorithm_config":\
{"emitter":"SingleInputAllReduceScatterFusion"}}
"""))
  assert [(r.collective, r.nbytes) for r in report.reductions] == [
      ("reduce-scatter", 8 * 64 * 4)]


# XLA TPU's spellings, shortened by these placeholders to fit the lines.
_TPU_CHAIN = """\
%start_fusion (p0: f32[64,64]) -> (f32[64,64], u32[]) {
  %p0 = f32[64,64] parameter(0)
  %ar.1 = f32[64,64] all-reduce(%p0), replica_groups={}, CHAIN
  ROOT %cc.1 = (f32[64,64], u32[]) custom-call(%ar.1), TARGET="Start"
}

%continuation (p0: f32[64,64], p1: u32[], p2: f32[8,64], p3: f32[64,64])
    -> (f32[64,64], u32[], f32[8,64]) {
  %p0 = f32[64,64] parameter(0)
  %p1 = u32[] parameter(1)
  %p2 = f32[8,64] parameter(2)
  %p3 = f32[64,64] parameter(3)
  %conv = f32[8,64] convolution(%p2, %p3), dim_labels=bf_io->bf
  %ar.2 = f32[64,64] all-reduce(%p0), replica_groups={}, CHAIN
  ROOT %t = (f32[64,64], u32[], f32[8,64]) tuple(%p0, %p1, %conv)
}

%done_fusion (p0: f32[64,64], p1: u32[]) -> f32[64,64] {
  %p0 = f32[64,64] parameter(0)
  %p1 = u32[] parameter(1)
  %ar.3 = f32[64,64] all-reduce(%p0), replica_groups={}, CHAIN
  ROOT %cc.3 = f32[64,64] custom-call(%p0, %p1, %ar.3), TARGET="Done"
}
""".replace("CHAIN", 'frontend_attributes={chain_id="0"}').replace(
    'TARGET="', 'custom_call_target="AsyncCollective').replace(
        ")\n    ->", ") ->")


def test_xla_tpu_asynchronous_collective_fusions_count_once():
  """Start, a continuation (the weight-gradient convolution fused with the
  collective's next steps) and done: one all-reduce, overlapped, the
  convolution's flops between."""
  report = oa.reduction_overlap(_module("""\
  %acs = (f32[64,64], u32[]) fusion(%w), kind=kCustom, calls=%start_fusion
  %g0 = f32[64,64] get-tuple-element(%acs), index=0
  %g1 = u32[] get-tuple-element(%acs), index=1
  %cont = (f32[64,64], u32[], f32[8,64]) fusion(%g0, %g1, %x, %w), """
      """kind=kOutput, calls=%continuation
  %h0 = f32[64,64] get-tuple-element(%cont), index=0
  %h1 = u32[] get-tuple-element(%cont), index=1
  ROOT %acd = f32[64,64] fusion(%h0, %h1), kind=kCustom, calls=%done_fusion
""", _TPU_CHAIN))
  assert report.num_reductions == 1
  (reduction,) = report.reductions
  assert reduction.name == "acs" and reduction.collective == "all-reduce"
  assert reduction.overlapped and reduction.flops_between == _DOT_FLOPS


# A loop of three trips whose body multiplies and all-reduces.
_LOOP = """\
%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[64,64] get-tuple-element(%p), index=1
  %d = f32[64,64] dot(%w, %w), lhs_contracting_dims={1}
  %inner = f32[64,64] all-reduce(%d), replica_groups={}
  ROOT %t = (s32[], f32[64,64]) tuple(%i, %inner)
}

%cond (p: (s32[], f32[64,64])) -> pred[] {
  %p = (s32[], f32[64,64]) parameter(0)
  ROOT %c = pred[] constant(true)
}
"""


def test_a_loop_of_matmuls_is_the_last_and_its_reductions_are_left_out():
  """A scan's backward: the reduction after it is not overlapped; one in
  its body runs once per iteration and is not this report's."""
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
  %loop = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body, """
      """backend_config={"known_trip_count":{"n":"3"}}
  ROOT %done = f32[64,64] all-reduce-done(%start)
""", _LOOP))
  (reduction,) = report.reductions
  assert reduction.name == "start"
  assert reduction.flops_between == 3 * 2 * 64 * 64 * 64  # 3 trips.
  assert reduction.overlapped  # it runs beside the loop.


def test_why_not_hidden_names_a_loop_that_ends_with_the_last_matmul():
  """A reduction after the loop holding the last matmul: the loop is why
  (the micro-batch loop kept whole, or scanned layers)."""
  report = oa.reduction_overlap(_module("""\
  %loop = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
  ROOT %done = f32[64,64] all-reduce-done(%start)
""", _LOOP))
  assert report.last_matmul_in_loop and report.overlapped_share == 0.0
  (why,) = report.why_not_hidden
  assert why.startswith("100.0% of the bytes (0.02 MiB) in 1 reductions")
  assert "in a loop" in why and "overlap_reduction=False" in why
  assert "default because" in why and "twice" in why  # why it is off.
  assert "not hidden: 100.0%" in str(report)


def test_why_not_hidden_tells_synchronous_from_late_reductions():
  """One synchronous reduction before the last dot, one asynchronous after
  it, one overlapped: two causes, by their bytes."""
  report = oa.reduction_overlap(_module("""\
  %ar = f32[32,64] all-reduce(%v), replica_groups={}
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
""" + _DOTS + """\
  %done = f32[64,64] all-reduce-done(%start)
  %late = f32[32,64] all-reduce-start(%v), replica_groups={}
  ROOT %late_done = f32[32,64] all-reduce-done(%late)
"""))
  assert not report.last_matmul_in_loop
  assert report.overlapped_share == pytest.approx(0.5)
  sync, late = report.why_not_hidden
  assert sync.startswith("25.0% of the bytes") and "synchronous" in sync
  assert "LIBTPU_INIT_ARGS" in sync
  assert late.startswith("25.0% of the bytes") and "embedding" in late


def test_a_late_reduction_beside_an_update_says_what_work_runs_beside_it():
  """After the last dot, one reduction waits on nothing, and the next runs
  beside an elementwise update of another leaf (an optimizer's, in a train
  step) that writes more than it reduces: the bytes written are counted,
  the share is not changed, and the cause names the work."""
  late = """  %late = f32[32,64] all-reduce-start(%v), replica_groups={}
  %update = f32[64,64] fusion(%w), kind=kLoop, calls=%add
  %late_done = f32[32,64] all-reduce-done(%late)
  %lone = f32[32,64] all-reduce-start(%late_done), replica_groups={}
  %gte = f32[64,64] bitcast(%update)
  ROOT %lone_done = f32[32,64] all-reduce-done(%lone)
"""
  report = oa.reduction_overlap(_module(_DOTS + late))
  assert report.overlapped_share == 0.0
  beside, alone = report.reductions
  assert beside.bytes_written_between == 64 * 64 * 4
  assert alone.bytes_written_between == 0  # a bitcast computes nothing.
  (why,) = report.why_not_hidden
  assert "Of those, 1 runs beside other work" in why and "0.02 MiB" in why
  assert "optimizer's update" in why
  bare = oa.reduction_overlap(_module(_DOTS + late.replace(
      "fusion(%w), kind=kLoop, calls=%add", "bitcast(%w)")))
  assert "beside other work" not in str(bare)


def test_nothing_to_say_where_every_reduction_is_hidden():
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
""" + _DOTS + """\
  ROOT %done = f32[64,64] all-reduce-done(%start)
"""))
  assert report.why_not_hidden == () and "not hidden" not in str(report)


def test_cublas_gemms_are_matrix_multiplies():
  report = oa.reduction_overlap(_module("""\
  %start = f32[64,64] all-reduce-start(%w), replica_groups={}
  %gemm = (f32[8,64], s8[1024]{0}) custom-call(%x, %w), """
      """custom_call_target="__cublas$gemm", backend_config="""
      """{"gemm_backend_config":{"dot_dimension_numbers":"""
      """{"lhs_contracting_dimensions":["1"],"""
      """"rhs_contracting_dimensions":["0"]}}}
  ROOT %done = f32[64,64] all-reduce-done(%start)
"""))
  assert report.reductions[0].flops_between == _DOT_FLOPS
  assert report.reductions[0].overlapped


def test_scalars_and_small_reductions_are_left_out():
  entry = _DOTS + """\
  %loss = f32[] all-reduce(%l), replica_groups={}
  ROOT %ar = f32[32,64] all-reduce(%v), replica_groups={}
"""
  assert oa.reduction_overlap(_module(entry)).num_reductions == 1
  report = oa.reduction_overlap(_module(entry), min_bytes=32 * 64 * 4 + 1)
  assert report.num_reductions == 0 and report.overlapped_share == 0.0
  assert str(report) == "no gradient-sized reduction outside loops"


def test_data_axes_leave_out_the_model_axis_reductions():
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  text = _module(_DOTS + """\
  %tp = f32[32,64] all-reduce(%v), replica_groups={{0,1,2,3},{4,5,6,7}}
  ROOT %dp = f32[64,64] all-reduce(%w), replica_groups=[4,2]<=[2,4]T(1,0)
""")
  assert oa.reduction_overlap(text).num_reductions == 2
  report = oa.reduction_overlap(text, data_axes="data", mesh=mesh)
  assert [r.name for r in report.reductions] == ["dp"]


def test_what_it_cannot_read_is_named():
  with pytest.raises(TypeError, match="got int") as info:
    oa.reduction_overlap(3)
  assert "program" in "".join(info.value.__notes__)
  with pytest.raises(ValueError, match="not scheduled"):
    oa.reduction_overlap(_module(_DOTS, scheduled=False))
  with pytest.raises(ValueError, match="min_bytes must be"):
    oa.reduction_overlap(_module(_DOTS), min_bytes=-1)
  with pytest.raises(ValueError, match="data_axes"):
    oa.reduction_overlap(_module(_DOTS), data_axes="data")


def test_a_compiled_step_on_the_cpu_says_its_reductions_are_synchronous():
  """The CPU backend runs every all-reduce synchronously: the report says
  so for a real step of the loop kept whole (the default)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      jax.sharding.AxisType.Explicit,))
  params = {"w": jax.numpy.ones((16, 16))}
  batch = jax.numpy.ones((32, 16))
  loss = lambda p, x: jax.numpy.mean(jax.numpy.tanh(x @ p["w"]) ** 2)
  step = oa.value_and_grad(loss, num_microbatches=4, equal_weights=True)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step).lower(
        params, jax.device_put(batch, jax.P("data"))).compile()
  report = oa.reduction_overlap(compiled)
  assert report.num_reductions == 1 and report.overlapped_share == 0.0
  (why,) = report.why_not_hidden
  assert why.startswith("100.0% of the bytes") and "synchronous" in why
