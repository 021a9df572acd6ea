"""The HLO reader behind ``oa.count_collectives``: places and mesh axes.

Places (in a loop, in a branch, outside) are read from hand-written HLO. Mesh
axes are read from the device groups of programs compiled on 8 simulated
devices (every spelling XLA uses: listed groups, iota lists, Shardy's mesh
axes, source-target pairs) and from hand-written groups for the spellings a
small program does not produce.
"""

import itertools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import optax_accum as oa
from optax_accum._src.compiled import hlo

_HLO = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %ar = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add
  %ags = (f32[4]{0}, f32[8]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%emit (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%x), dimensions={0}, to_apply=%add
}

%skip (x: f32[4]) -> f32[4] {
  ROOT %x = f32[4]{0} parameter(0)
}

%scatter (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%x), dimensions={0}, to_apply=%add
}

%wrapped (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %cp = f32[4]{0} collective-permute(%x), source_target_pairs={{0,1}}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond, body=%body
  %c = f32[4]{0} conditional(%pred, %x, %x), branch_computations={%emit, %skip}
  %f = f32[4]{0} fusion(%c), kind=kLoop, calls=%wrapped
  %as = ((f32[4]{0}), f32[4]{0}) async-start(%f), calls=%scatter
  %ad = f32[4]{0} async-done(%as), calls=%scatter
  ROOT %a2a = f32[4]{0} all-to-all(%ad), dimensions={0}
}
"""


def test_count_collectives_places_each_collective():
  counts = oa.count_collectives(_HLO)
  assert counts.in_loop == {"all-gather": 1, "all-reduce": 1}
  assert counts.in_branch == {"reduce-scatter": 1}
  assert counts.outside == {
      "all-to-all": 1, "collective-permute": 1, "reduce-scatter": 1,
  }
  assert counts.total == {
      "all-gather": 1, "all-reduce": 1, "all-to-all": 1,
      "collective-permute": 1, "reduce-scatter": 2,
  }
  assert counts.by_axes is None  # no mesh given.


def test_count_collectives_rejects_what_is_not_compiled_hlo():
  lowered = jax.jit(jnp.sin).lower(1.0)
  with pytest.raises(ValueError, match="StableHLO"):
    oa.count_collectives(lowered.as_text())
  with pytest.raises(TypeError, match="compiled program"):
    oa.count_collectives(42)
  assert oa.count_collectives(lowered).total == {}  # compiled for us.
  with pytest.raises(TypeError, match="include_scalars must be a bool, got"
                     " 'no'"):
    oa.count_collectives(lowered, include_scalars="no")
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"
                     r" \(or AbstractMesh\) or None, got 'data'"):
    oa.count_collectives(lowered, mesh="data")
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
    oa.check_train_step(lowered, num_microbatches=None, mesh=("data",))


def _loop_and_after(mesh):
  """A program with an all-reduce over 'b' in a scan and one over 'a' after."""
  def step(x):
    total, _ = jax.lax.scan(
        lambda c, xi: (c + jax.lax.psum(xi, "b"), None), jnp.zeros(16), x)
    return jax.lax.psum(total, "a")

  return jax.shard_map(step, mesh=mesh, in_specs=P(None, mesh.axis_names),
                       out_specs=P(), check_vma=False)


def _same_counts(program, text, mesh):
  for kwargs in ({}, {"mesh": mesh}, {"include_scalars": False}):
    assert oa.count_collectives(program, **kwargs) == oa.count_collectives(
        text, **kwargs), kwargs


def test_count_collectives_reads_every_stage_of_jit_as_its_text():
  mesh = _auto_mesh((2, 4), ("a", "b"))
  lowered = jax.jit(_loop_and_after(mesh)).lower(jnp.ones((3, 128)))
  compiled = lowered.compile()
  text = compiled.as_text()
  counts = oa.count_collectives(text, mesh=mesh)
  assert counts.in_loop == {"all-reduce": 1}
  assert counts.outside == {"all-reduce": 1}
  assert list(counts.by_axes) == [("a",), ("b",)]
  for program in (compiled, lowered, compiled.runtime_executable()):
    _same_counts(program, text, mesh)


def test_count_collectives_reads_the_stages_of_nnx_jit():
  """nnx.jit's Lowered and Compiled wrap jax's: read as their text."""
  nnx = pytest.importorskip("flax.nnx")
  mesh = _auto_mesh((2, 4), ("a", "b"))
  lowered = nnx.jit(_loop_and_after(mesh)).lower(jnp.ones((3, 128)))
  compiled = lowered.compile()
  assert not isinstance(compiled, jax.stages.Compiled)  # flax's own class.
  text = compiled.as_text()
  assert oa.count_collectives(compiled).in_loop == {"all-reduce": 1}
  _same_counts(compiled, text, mesh)
  _same_counts(lowered, text, mesh)


_COMBINED = """\
%wrapped (p0: f32[1], p1: f32[1]) -> f32[2] {
  %p0 = f32[1]{0} parameter(0)
  %p1 = f32[1]{0} parameter(1)
  ROOT %c = f32[2]{0} concatenate(%p0, %p1), dimensions={0}
}

%wrapped_grads (p0: f32[16], p1: f32[1]) -> f32[17] {
  %p0 = f32[16]{0} parameter(0)
  %p1 = f32[1]{0} parameter(1)
  ROOT %c = f32[17]{0} concatenate(%p0, %p1), dimensions={0}
}

ENTRY %main (x: f32[], t: f32[1], g: f32[16], w: f32[2]) -> f32[2] {
  %x = f32[] parameter(0)
  %t = f32[1]{0} parameter(1)
  %g = f32[16]{0} parameter(2)
  %w = f32[2]{0} parameter(3)
  %xb = f32[1]{0} bitcast(%x)
  %scalars = f32[2]{0} concatenate(%xb, %t), dimensions={0}
  %fused = f32[2]{0} fusion(%xb, %t), kind=kLoop, calls=%wrapped
  %grads = f32[17]{0} fusion(%g, %t), kind=kLoop, calls=%wrapped_grads
  %a = f32[] all-reduce(%x), replica_groups={}, to_apply=%add
  %b = (f32[], f32[]) all-reduce(%x, %x), replica_groups={}, to_apply=%add
  %c = f32[2]{0} all-reduce(%scalars), replica_groups={}, to_apply=%add
  %d = f32[2]{0} all-reduce-start(%fused), replica_groups={}, to_apply=%add
  %e = f32[2]{0} all-reduce(%w), replica_groups={}, to_apply=%add
  %f = f32[17]{0} all-reduce(%grads), replica_groups={}, to_apply=%add
  ROOT %h = (f32[], f32[16]{0}) all-reduce(%x, %g), replica_groups={}
}"""


def test_include_scalars_false_leaves_out_what_xla_made_of_scalars():
  """Scalars, a tuple of them, and XLA's concatenations of scalars (GPU).

  Not a gradient of two elements, a concatenation of gradients, or a tuple
  of a gradient and a scalar.
  """
  found = {c.nbytes: c.scalar for c in hlo.collectives(_COMBINED)}
  assert [c.scalar for c in hlo.collectives(_COMBINED)] == [
      True, True, True, True, False, False, False]
  assert found[68] is False  # f32[17]: the gradient concatenated.
  counts = oa.count_collectives(_COMBINED, include_scalars=False)
  assert counts.total == {"all-reduce": 3}
  assert oa.count_collectives(_COMBINED).total == {"all-reduce": 7}


_TPU_REDUCE_SCATTER = """\
%all-reduce-scatter.5 (input_0: f32[128,512]) -> (f32[16,512]) {
  %input_0 = f32[128,512]{1,0:T(8,128)} parameter(0)
  %all-reduce.23 = (f32[128,512]{1,0:T(8,128)}) all-reduce(%input_0), \
replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %gte = f32[128,512]{1,0:T(8,128)} get-tuple-element(%all-reduce.23), index=0
  %slice = f32[16,512]{1,0:T(8,128)} dynamic-slice(%gte, %i, %z), \
dynamic_slice_sizes={16,512}
  ROOT %tuple.13 = (f32[16,512]{1,0:T(8,128)}) tuple(%slice)
}

ENTRY %main (g: f32[128,512]) -> (f32[16,512]) {
  %g = f32[128,512]{1,0:T(8,128)} parameter(0)
  ROOT %fusion.210 = (f32[16,512]{1,0:T(8,128)}) fusion(%g), kind=kCustom, \
calls=%all-reduce-scatter.5, backend_config={"collective_algorithm_config":\
{"emitter":"AllReduceScatterFusion","strategy":"StrategyRing"}}
}"""


def test_xla_tpu_reduce_scatter_fusion_is_a_reduce_scatter():
  """XLA's TPU compiler writes a reduce-scatter as an all-reduce + slice
  fused under the AllReduceScatterFusion emitter: one reduce-scatter of
  the fusion's result, not a whole-gradient all-reduce."""
  mesh = jax.sharding.AbstractMesh((8,), ("fsdp",))
  [found] = hlo.collectives(_TPU_REDUCE_SCATTER, mesh)
  assert found.collective == "reduce-scatter"
  assert found.nbytes == 16 * 512 * 4  # each device's part.
  assert found.axes == ("fsdp",)
  plain = _TPU_REDUCE_SCATTER.replace("AllReduceScatterFusion", "Other")
  assert [c.collective for c in hlo.collectives(plain)] == ["all-reduce"]
  # Its padded form (a dimension the devices do not divide into tiles),
  # seen at benchmark k's 1B size (libtpu for jax 0.10.2).
  single = _TPU_REDUCE_SCATTER.replace(
      "AllReduceScatterFusion", "SingleInputAllReduceScatterFusion")
  assert [c.collective for c in hlo.collectives(single)] == ["reduce-scatter"]


# XLA TPU's asynchronous all-reduce (libtpu 0.0.42.1, with
# --xla_tpu_enable_async_collective_fusion...): start, a continuation (the
# next weight gradient's convolution) and done, each with a copy of it.
_TPU_ASYNC_ALL_REDUCE = """\
%start (p: f32[64]) -> (f32[64], u32[]) {
  %p = f32[64] parameter(0)
  %ar.1 = f32[64] all-reduce(%p), replica_groups={}, CHAIN
  ROOT %s = (f32[64], u32[]) custom-call(%ar.1), TARGET="Start"
}

%next (p: f32[64], x: f32[8,64], w: f32[64,64]) -> (f32[64], f32[8,64]) {
  %p = f32[64] parameter(0)
  %x = f32[8,64] parameter(1)
  %w = f32[64,64] parameter(2)
  %c = f32[8,64] convolution(%x, %w), dim_labels=bf_io->bf
  %ar.2 = f32[64] all-reduce(%p), replica_groups={}, CHAIN
  ROOT %t = (f32[64], f32[8,64]) tuple(%p, %c)
}

%done (p: f32[64], q: u32[]) -> f32[64] {
  %p = f32[64] parameter(0)
  %q = u32[] parameter(1)
  %ar.3 = f32[64] all-reduce(%p), replica_groups={}, CHAIN
  ROOT %d = f32[64] custom-call(%p, %q, %ar.3), TARGET="Done"
}

ENTRY %main (g: f32[64], x: f32[8,64], w: f32[64,64]) -> f32[64] {
  %acs = (f32[64], u32[]) fusion(%g), kind=kCustom, calls=%start
  %a = f32[64] get-tuple-element(%acs), index=0
  %b = u32[] get-tuple-element(%acs), index=1
  %cont = (f32[64], f32[8,64]) fusion(%a, %x, %w), calls=%next
  %e = f32[64] get-tuple-element(%cont), index=0
  ROOT %acd = f32[64] fusion(%e, %b), kind=kCustom, calls=%done
}""".replace("CHAIN", 'frontend_attributes={chain_id="0"}').replace(
    'TARGET="', 'custom_call_target="AsyncCollective')


def test_xla_tpu_asynchronous_all_reduce_counts_once():
  """Its chain runs the all-reduce once: counted at the start, not again in
  the continuation and the done (oa.reduction_overlap pairs them)."""
  counts = oa.count_collectives(_TPU_ASYNC_ALL_REDUCE)
  assert counts.total == {"all-reduce": 1}
  [found] = hlo.collectives(_TPU_ASYNC_ALL_REDUCE)
  assert found.nbytes == 64 * 4
  # The same all-reduces, untagged, are three.
  untagged = _TPU_ASYNC_ALL_REDUCE.replace('chain_id="0"', 'x="0"')
  assert oa.count_collectives(untagged).total == {"all-reduce": 3}


def test_by_axes_splits_the_places_of_every_collective():
  """Groups absent or {} mean every device: all axes of size above 1."""
  mesh = jax.sharding.AbstractMesh((2, 1, 4), ("data", "fsdp", "model"))
  text = _HLO.replace(
      "source_target_pairs={{0,1}}", "source_target_pairs={{0,1},{1,0}}")
  counts = oa.count_collectives(text, mesh=mesh)
  assert list(counts.by_axes) == [("model",), ("data", "model")]
  over_model = counts.by_axes[("model",)]
  assert over_model.total == over_model.outside == {"collective-permute": 1}
  for place in ("total", "in_loop", "in_branch", "outside"):
    summed = {}
    for by_place in counts.by_axes.values():
      for name, n in getattr(by_place, place).items():
        summed[name] = summed.get(name, 0) + n
    assert summed == getattr(counts, place), place


# Programs compiled on 8 simulated devices (tests/conftest.py).

_MESHES = {
    (2, 4): ("a", "b"),
    (2, 2, 2): ("a", "b", "c"),
    (1, 8): ("a", "b"),
}


def _auto_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _subsets(names):
  return [axes for r in (1, 2, 3) for axes in itertools.combinations(names, r)]


def _spanned(mesh, axes):
  """The expected key: the reduced axes of size above 1, in mesh order."""
  return tuple(name for name in mesh.axis_names
               if name in axes and mesh.shape[name] > 1)


def _by_axes(f, mesh, *args):
  compiled = jax.jit(f).lower(*args).compile()
  return oa.count_collectives(compiled, mesh=mesh).by_axes


@pytest.mark.parametrize(
    "shape, axes",
    [(shape, axes) for shape, names in _MESHES.items()
     for axes in _subsets(names)],
    ids=str,
)
def test_by_axes_of_a_psum_over_mesh_axes(shape, axes):
  mesh = _auto_mesh(shape, _MESHES[shape])
  reversed_axes = axes[::-1]  # a psum names axes in any order.
  f = jax.shard_map(lambda x: jax.lax.psum(x, reversed_axes), mesh=mesh,
                    in_specs=P(mesh.axis_names), out_specs=P(),
                    check_vma=False)
  by_axes = _by_axes(f, mesh, jnp.ones(8))
  assert list(by_axes) == [_spanned(mesh, axes)]
  assert by_axes[_spanned(mesh, axes)].outside == {"all-reduce": 1}


def test_by_axes_of_gathers_scatters_and_permutes():
  mesh = _auto_mesh((2, 2, 2), ("data", "fsdp", "tensor"))

  def step(x):
    gathered = jax.lax.all_gather(x, "tensor", tiled=True)
    scattered = jax.lax.psum_scatter(gathered, ("data", "fsdp"), tiled=True)
    shifted = jax.lax.ppermute(x, "fsdp", [(0, 1), (1, 0)])
    return scattered.sum() + shifted.sum()

  f = jax.shard_map(step, mesh=mesh, in_specs=P(mesh.axis_names),
                    out_specs=P(), check_vma=False)
  by_axes = _by_axes(f, mesh, jnp.ones(32))
  assert by_axes[("tensor",)].total == {"all-gather": 1}
  assert by_axes[("fsdp",)].total == {"collective-permute": 1}
  assert by_axes[("data", "fsdp")].total == {"reduce-scatter": 1}


def test_by_axes_of_the_gradient_reduction_jit_inserts():
  """Replicated parameters, a batch over two axes: one all-reduce over both."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  with jax.set_mesh(mesh):
    x = jax.device_put(jnp.ones((8, 4)), P(("data", "fsdp")))
    by_axes = _by_axes(jax.grad(loss), mesh, jnp.ones((4, 4)), x)
  assert list(by_axes) == [("data", "fsdp")]
  assert by_axes[("data", "fsdp")].total == {"all-reduce": 1}


def test_by_axes_of_an_fsdp_and_tensor_parallel_gradient():
  """Parameters over fsdp x tensor: XLA's iota groups, read axis by axis."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones((16, 16)), P("fsdp", "tensor"))
    x = jax.device_put(jnp.ones((8, 16)), P(("data", "fsdp")))
    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
  counts = oa.count_collectives(compiled, mesh=mesh)
  assert counts.by_axes  # every collective got its axes.
  assert ("tensor",) not in counts.by_axes  # the batch is not over tensor.
  assert counts.by_axes[("fsdp",)].total.get("all-gather") == 1  # params.
  assert sum(sum(c.total.values()) for c in counts.by_axes.values()) == sum(
      counts.total.values())


def test_by_axes_follows_the_program_device_order():
  """On a mesh whose devices are not in id order, groups are positions."""
  devices = np.array(jax.devices())[[3, 1, 7, 5, 0, 2, 4, 6]].reshape(2, 4)
  mesh = Mesh(devices, ("a", "b"))
  f = jax.shard_map(lambda x: jax.lax.psum(x, "a"), mesh=mesh,
                    in_specs=P(("a", "b")), out_specs=P(), check_vma=False)
  compiled = jax.jit(f).lower(jnp.ones(8)).compile()
  assert list(oa.count_collectives(compiled, mesh=mesh).by_axes) == [("a",)]
  text = compiled.as_text()  # ids in the mesh's order as well.
  assert list(oa.count_collectives(text, mesh=mesh).by_axes) == [("a",)]
  # The same program read against a mesh of other devices is refused.
  other = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
  with pytest.raises(ValueError, match="compiled for"):
    oa.count_collectives(compiled, mesh=other)


# Spellings of device groups, hand-written.

_DATA_MODEL = jax.sharding.AbstractMesh((4, 2), ("data", "model"))


@pytest.mark.parametrize("groups, axes", [
    ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("data",)),
    ("replica_groups=[4,2]<=[8]", ("model",)),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", ("data",)),
    ("replica_groups={}", ("data", "model")),
    ("replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}",
     ("data",)),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}",
     ("model",)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4],"
     " device_ids=([4,2]T(1,0)) {'axis_0'}", ("model",)),
    ("replica_groups=mesh['x'=2,'y'=4], device_ids=(0,2,4,6,1,3,5,7) {'x'}",
     ("model",)),
    ("replica_groups=mesh['x'=8] {'x':(2)2}", ("data",)),  # ids 0, 2.
    ("replica_groups=mesh['x'=8] {'x':(1)2,'x':(4)2}", ("data", "model")),
    ("source_target_pairs={{0,2},{2,4},{4,6},{6,0}}", ("data",)),
])
def test_by_axes_reads_each_spelling_of_device_groups(groups, axes):
  text = ("ENTRY %main (x: f32[8]) -> f32[8] {\n"
          f"  ROOT %c = f32[8] all-reduce(%x), {groups}, to_apply=%add\n}}")
  assert list(oa.count_collectives(text, mesh=_DATA_MODEL).by_axes) == [axes]


@pytest.mark.parametrize("groups, message", [
    ("replica_groups={{0,8}}", "only 8 devices"),
    ("replica_groups=<unknown>", "Cannot read the device groups"),
    ("replica_groups=mesh['x'=8], device_ids=([8]Q) {'x'}", "device_ids"),
])
def test_by_axes_refuses_groups_it_cannot_place(groups, message):
  text = ("ENTRY %main (x: f32[8]) -> f32[8] {\n"
          f"  ROOT %c = f32[8] all-reduce(%x), {groups}, to_apply=%add\n}}")
  assert oa.count_collectives(text).total == {"all-reduce": 1}
  with pytest.raises(ValueError, match=message):
    oa.count_collectives(text, mesh=_DATA_MODEL)
