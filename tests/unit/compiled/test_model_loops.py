"""``oa.reduction_overlap`` on the reductions inside a model's own loops.

Hand-written scheduled HLO: a loop body with GPU's start and done around a
dot (overlapped, once per trip), with nothing between them, synchronous,
XLA TPU's asynchronous collective fusions (shaped as libtpu 0.0.42.1 writes
them in ``oa.scan_layers``' backward loop), nested loops, and the
micro-batch loop, whose reductions stay out. And a real step of
``oa.scan_layers`` on 8 CPU devices, whose collectives are synchronous.
Programs compiled for H100s and TPU v5e: tests/compiled/.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.microbatch import layer_sums

_SLICE_BYTES = 64 * 64 * 4  # one layer's slice, f32[64,64].
_DOT_FLOPS = 2 * 8 * 64 * 64  # f32[8,64] x f32[64,64].
_COND = """\
%cond (p: (s32[], f32[64,64], f32[8,64])) -> pred[] {
  %p = (s32[], f32[64,64], f32[8,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(TRIPS)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}
"""
_BODY_HEAD = """\
%body (p: (s32[], f32[64,64], f32[8,64])) -> (s32[], f32[64,64], f32[8,64]) {
  %p = (s32[], f32[64,64], f32[8,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = f32[64,64] get-tuple-element(%p), index=1
  %x = f32[8,64] get-tuple-element(%p), index=2
"""
_BODY_ROOT = """\
  ROOT %t = (s32[], f32[64,64], f32[8,64]) tuple(%i, %r, %dx)
}
"""


def _module(body: str, trips: int = 4, after: str = "", extra: str = "",
            op_name: str = "jit(step)/shard_map/scan/while") -> str:
  """A scheduled module: ``body`` in a loop of ``trips`` trips, then
  ``after`` in the entry computation."""
  return f"""HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

{extra}{_COND.replace("TRIPS", str(trips))}
{_BODY_HEAD}{body}{_BODY_ROOT}
ENTRY %main (w: f32[64,64], x: f32[8,64], e: f32[256,64]) -> f32[256,64] {{
  %w = f32[64,64] parameter(0)
  %x = f32[8,64] parameter(1)
  %e = f32[256,64] parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64], f32[8,64]) tuple(%zero, %w, %x)
  %loop = (s32[], f32[64,64], f32[8,64]) while(%init), condition=%cond, \
body=%body, metadata={{op_name="{op_name}"}}
{after}  ROOT %out = f32[256,64] copy(%e)
}}
"""


# The entry's reduction after the loop: f32[256,64], 64 KiB, asynchronous.
_AFTER = """\
  %late = f32[256,64] all-reduce-start(%e), replica_groups={}, to_apply=%add
  %late_done = f32[256,64] all-reduce-done(%late)
"""
_START_DOT_DONE = """\
  %r.start = f32[64,64] all-reduce-start(%w), replica_groups={}, to_apply=%add
  %dx = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %r = f32[64,64] all-reduce-done(%r.start)
"""


def test_a_reduction_beside_a_dot_in_a_loop_is_overlapped_once_per_trip():
  """4 trips of a 16 KiB slice beside the layer's dot, a 64 KiB leaf after
  the loop: half the bytes hidden, and the loop not blamed for the rest."""
  report = oa.reduction_overlap(_module(_START_DOT_DONE, after=_AFTER))
  (inside,) = report.loop_reductions
  assert inside == ("r.start", "all-reduce", _SLICE_BYTES, 4, True,
                    _DOT_FLOPS, "loop")
  assert inside.overlapped and inside.total_bytes == 4 * _SLICE_BYTES
  assert [r.name for r in report.reductions] == ["late"]
  assert report.num_reductions == 5
  assert report.total_bytes == 2 * 4 * _SLICE_BYTES
  assert report.overlapped_bytes == 4 * _SLICE_BYTES
  assert report.overlapped_share == 0.5
  assert report.last_matmul_in_loop
  (why,) = report.why_not_hidden
  assert why.startswith("50.0% of the bytes (0.06 MiB) in 1 reductions")
  assert "reduces gradients inside it" in why and "embedding" in why
  assert "final only when it ends" not in why
  text = str(report)
  assert "5 reductions, 5 asynchronous" in text
  assert "4 of those inside a model's loop" in text
  assert "4 with a matrix multiply between start and done" in text


def test_nothing_between_start_and_done_in_a_loop_is_not_overlapped():
  report = oa.reduction_overlap(_module("""\
  %r.start = f32[64,64] all-reduce-start(%w), replica_groups={}, to_apply=%add
  %r = f32[64,64] all-reduce-done(%r.start)
  %dx = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
""", trips=3))
  (inside,) = report.loop_reductions
  assert inside.asynchronous and inside.flops_between == 0
  assert not inside.overlapped and inside.trips == 3
  assert report.overlapped_share == 0.0 and report.num_reductions == 3
  (why,) = report.why_not_hidden
  assert why.startswith("100.0% of the bytes (0.05 MiB) in 3 reductions"
                        " inside a model's loop with no matrix multiply")


def test_a_synchronous_reduction_in_a_loop_is_counted_once_per_trip():
  report = oa.reduction_overlap(_module("""\
  %dx = f32[8,64] dot(%x, %w), lhs_contracting_dims={1}
  %r = f32[64,64] all-reduce(%w), replica_groups={}, to_apply=%add
""", after=_AFTER))
  (inside,) = report.loop_reductions
  assert not inside.asynchronous and not inside.overlapped
  sync, late = report.why_not_hidden
  assert sync.startswith("50.0% of the bytes (0.06 MiB) in 4 synchronous")
  # The loop hides nothing: a reduction after it is the loop's to blame.
  assert "final only when it ends" in late


# XLA TPU's asynchronous collective fusions as libtpu 0.0.42.1 writes them
# in oa.scan_layers' backward loop (its tuples of semaphores shortened to
# one u32[]): a start fusion, a continuation computing the layer's input
# gradient beside a copy of the all-reduce, a done fusion; the loop's trip
# count is its condition's bound (no known_trip_count).
_TPU_FUSIONS = """\
%acs_computation (p0: f32[64,64]) -> (f32[64,64], u32[]) {
  %p0 = f32[64,64] parameter(0)
  %ar.1 = f32[64,64] all-reduce(%p0), channel_id=1, replica_groups={}, \
to_apply=%add, CHAIN
  ROOT %cc.1 = (f32[64,64], u32[]) custom-call(%ar.1), TARGET="Start"
}

%continuation (p0: f32[64,64], p1: u32[], p2: f32[8,64], p3: f32[64,64]) \
-> (f32[8,64], f32[64,64], u32[]) {
  %p0 = f32[64,64] parameter(0)
  %p1 = u32[] parameter(1)
  %p2 = f32[8,64] parameter(2)
  %p3 = f32[64,64] parameter(3)
  %conv = f32[8,64] convolution(%p2, %p3), dim_labels=bf_oi->bf
  %ar.2 = f32[64,64] all-reduce(%p0), channel_id=1, replica_groups={}, \
to_apply=%add, CHAIN
  ROOT %t = (f32[8,64], f32[64,64], u32[]) tuple(%conv, %p0, %p1)
}

%acd_computation (p0: f32[64,64], p1: u32[]) -> f32[64,64] {
  %p0 = f32[64,64] parameter(0)
  %p1 = u32[] parameter(1)
  %ar.3 = f32[64,64] all-reduce(%p0), channel_id=1, replica_groups={}, \
to_apply=%add, CHAIN
  ROOT %cc.3 = f32[64,64] custom-call(%p0, %p1, %ar.3), TARGET="Done"
}
""".replace("CHAIN", 'frontend_attributes={chain_id="0"}').replace(
    'TARGET="', 'custom_call_target="AsyncCollective')
_TPU_BODY = """\
  %async-collective-start = (f32[64,64], u32[]) fusion(%w), kind=kCustom, \
calls=%acs_computation
  %g0 = f32[64,64] get-tuple-element(%async-collective-start), index=0
  %g1 = u32[] get-tuple-element(%async-collective-start), index=1
  %fusion.105 = (f32[8,64], f32[64,64], u32[]) fusion(%g0, %g1, %x, %w), \
kind=kOutput, calls=%continuation
  %dx = f32[8,64] get-tuple-element(%fusion.105), index=0
  %h0 = f32[64,64] get-tuple-element(%fusion.105), index=1
  %h1 = u32[] get-tuple-element(%fusion.105), index=2
  %r = f32[64,64] fusion(%h0, %h1), kind=kCustom, calls=%acd_computation
"""


def test_xla_tpu_asynchronous_collective_fusions_in_a_loop_count_once():
  report = oa.reduction_overlap(_module(_TPU_BODY, trips=16, after=_AFTER,
                                        extra=_TPU_FUSIONS))
  (inside,) = report.loop_reductions
  assert inside == ("async-collective-start", "all-reduce", _SLICE_BYTES,
                    16, True, _DOT_FLOPS, "loop")
  assert report.num_reductions == 17
  assert report.overlapped_bytes == 16 * _SLICE_BYTES
  assert oa.count_collectives(_module(_TPU_BODY, trips=16,
                                      extra=_TPU_FUSIONS)).total == {
                                          "all-reduce": 1}


def test_the_microbatch_loop_and_loops_inside_it_are_left_out():
  """oa.value_and_grad's loop, by its named scope: its reductions (a
  per-micro-batch all-reduce, checked by oa.check_train_step) are not a
  model's loop's."""
  text = _module(_START_DOT_DONE, op_name=(
      "jit(step)/shard_map/optax_accum_microbatch_loop/while"))
  report = oa.reduction_overlap(text)
  assert report.loop_reductions == () and report.num_reductions == 0
  assert str(report) == "no gradient-sized reduction outside loops"


def test_nested_loops_multiply_their_trips():
  inner = _START_DOT_DONE.replace("%r =", "%r.inner =").replace(
      "(%r.start)", "(%r.start)\n  %r = f32[64,64] copy(%r.inner)")
  outer_cond = _COND.replace("%cond", "%outer_cond").replace("TRIPS", "3")
  outer_body = (_BODY_HEAD.replace("%body", "%outer_body") + """\
  %loop.inner = (s32[], f32[64,64], f32[8,64]) while(%p), condition=%cond, \
body=%body
  %r = f32[64,64] get-tuple-element(%loop.inner), index=1
  %dx = f32[8,64] get-tuple-element(%loop.inner), index=2
""" + _BODY_ROOT)
  text = _module(inner, trips=5).replace(
      "condition=%cond, body=%body, metadata",
      "condition=%outer_cond, body=%outer_body, metadata").replace(
          "\nENTRY", f"\n{outer_cond}\n{outer_body}\nENTRY")
  (inside,) = oa.reduction_overlap(text).loop_reductions
  assert inside.trips == 15 and inside.loop == "loop.inner"


def test_data_axes_leave_out_the_model_axis_reductions_in_loops():
  mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
  text = _module(_START_DOT_DONE.replace(
      "replica_groups={}", "replica_groups={{0,1,2,3},{4,5,6,7}}"))
  assert len(oa.reduction_overlap(text).loop_reductions) == 1
  report = oa.reduction_overlap(text, data_axes="data", mesh=mesh)
  assert report.loop_reductions == ()


LAYERS, DIM, VOCAB, ROWS, K = 4, 16, 32, 64, 4


@pytest.mark.parametrize("scan", [oa.scan_layers, lax.scan],
                         ids=["scan_layers", "lax.scan"])
def test_a_cpu_step_of_scan_layers_counts_each_layer_once(scan):
  """8 CPU devices, whose all-reduces are synchronous: nothing overlapped,
  oa.scan_layers' stack reduced in the backward loop, one layer per trip,
  and every gradient byte counted once (lax.scan: all after the loop)."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(
      jax.sharding.AxisType.Explicit,))
  step = oa.value_and_grad(
      helpers.stacked_layers_loss(scan), num_microbatches=K, axis_name="data",
      overlap_reduction=True, loss_reduction="sum",
      num_tokens_fn=lambda mb: jnp.sum(mb["ids"] >= 0, dtype=jnp.float32))
  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                               out_specs=P()))
  params = {"embed": jnp.ones((VOCAB, DIM)),
            "layers": jnp.ones((LAYERS, DIM, DIM)),
            "unembed": jnp.ones((DIM, VOCAB))}
  batch = {"ids": jnp.zeros((ROWS,), jnp.int32),
           "y": jnp.ones((ROWS, VOCAB))}
  with jax.set_mesh(mesh):
    compiled = step.lower(
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(batch, NamedSharding(mesh, P("data")))).compile()
  report = oa.reduction_overlap(compiled)
  assert report.overlapped_share == 0.0
  # XLA's CPU combiner adds the loss and the token count (two f32 scalars)
  # to one leaf's all-reduce.
  gradient = 4 * sum(x.size for x in params.values())
  assert gradient <= report.total_bytes <= gradient + 8
  if scan is lax.scan or not layer_sums.REDUCES_IN_LOOP:
    assert report.loop_reductions == ()  # older JAX: lax.scan there too.
    return
  (inside,) = report.loop_reductions
  assert inside.trips == LAYERS and inside.nbytes == 4 * DIM * DIM
  assert not inside.asynchronous
  assert report.num_reductions == LAYERS + len(report.reductions)
  assert "synchronous" in report.why_not_hidden[0]
