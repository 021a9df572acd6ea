"""The typed form: jax.jit with Explicit data axes, sharding in the types.

A decoder written for ``jax.jit`` (``zoo/typed_model.py``: annotations
that name the batch axes, an embedding read with ``out_sharding=``,
``jax.nn.dot_product_attention``, an elementwise positional add, integer
labels, FSDP and tensor-parallel weights) runs in ``oa.value_and_grad`` as
written, on three meshes, exactly as one device's full batch; the compiled
step reduces gradients over the data axes once, after the loop (the
positional embedding, which JAX cannot type ``reduced``, aside), gathers
nothing over ``tensor`` that the full-batch step does not, and holds less
temporary memory. The negative control: a naive ``lax.scan`` of
``jax.grad`` reduces every micro-batch.
"""

import os
import subprocess
import sys
import warnings

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.mesh import readers
from optax_accum._src.microbatch import reduced_fallbacks
from zoo import typed_model as tm

pytestmark = pytest.mark.skipif(
    not hasattr(P(), "unreduced"), reason="needs jax's unreduced types")

K = 2
BATCH = 32
MESHES = {
    "fsdp": ((8,), ("fsdp",), tm.Config(batch_axes=("fsdp",), fsdp="fsdp")),
    "data_tensor": ((4, 2), ("data", "tensor"),
                    tm.Config(batch_axes=("data",), tensor="tensor")),
    "data_fsdp_tensor": ((2, 2, 2), ("data", "fsdp", "tensor"),
                         tm.Config(batch_axes=("data", "fsdp"), fsdp="fsdp",
                                   tensor="tensor")),
}


def _mesh(name):
  shape, names, _ = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(
      shape))


def _placed(cfg):
  params = jax.tree.map(jax.device_put, tm.init(tm.Config()), tm.specs(cfg))
  return params, jax.device_put(tm.batch(tm.Config(), BATCH),
                                P(cfg.batch_axes))


def _reference(loss=None):
  cfg = tm.on_one_device(tm.Config())
  return jax.jit(jax.value_and_grad(loss or tm.loss_fn(cfg)))(
      tm.init(tm.Config()), tm.batch(tm.Config(), BATCH))


def _fn(cfg, **kwargs):
  kwargs.setdefault("num_tokens_fn", tm.num_tokens)
  return oa.value_and_grad(tm.loss_fn(cfg), num_microbatches=K, **kwargs)


def _close(got, want):
  helpers.assert_trees_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.slow
def test_a_cookbook_style_model_is_exact_and_reduces_after_the_loop(name):
  cfg = MESHES[name][2]
  mesh = _mesh(name)
  with jax.set_mesh(mesh):
    params, batch = _placed(cfg)
    step = jax.jit(_fn(cfg))
    full = jax.jit(jax.value_and_grad(tm.loss_fn(cfg)))
    with reduced_fallbacks.collecting() as reports:
      loss, grads = step(params, batch)
    compiled = step.lower(params, batch).compile()
    full_compiled = full.lower(params, batch).compile()
  _close((loss, grads), _reference())
  assert jax.tree.map(lambda g: jax.typeof(g).sharding.spec, grads) == (
      jax.tree.map(lambda p: jax.typeof(p).sharding.spec, params))
  assert reports[-1].fallback_leaves == ("params['pos']",)
  pos_bytes = tm.init(tm.Config())["pos"].size * 4
  ours = helpers.reduction_bytes(compiled, mesh, cfg.batch_axes)
  whole = helpers.reduction_bytes(full_compiled, mesh, cfg.batch_axes)
  # The fallback leaf only (XLA may fuse a scalar or two into its reduction,
  # or, jax 0.9, reduce it in halves over a 2-device model axis).
  assert pos_bytes // 2 <= ours["loop"] < pos_bytes + 64
  assert ours["out"] + pos_bytes <= 1.05 * whole["out"]
  if cfg.tensor:  # nothing gathered over "tensor" beyond the model's own.
    by_axes = oa.count_collectives(compiled, mesh=mesh).by_axes
    full_axes = oa.count_collectives(full_compiled, mesh=mesh).by_axes
    gathers = by_axes.get(("tensor",), oa.CollectiveCounts({}, {}, {}, {}))
    assert gathers.total.get("all-gather", 0) <= full_axes[
        ("tensor",)].total.get("all-gather", 0)


@pytest.mark.slow
def test_the_naive_scan_reduces_every_microbatch():
  """The negative control: jax.grad in a lax.scan reduces in the loop."""
  cfg = MESHES["data_tensor"][2]
  mesh = _mesh("data_tensor")
  loss = tm.loss_fn(cfg)

  def naive(params, batch):
    micro = jax.tree.map(
        lambda x: x.reshape((K, -1) + x.shape[1:],
                            out_sharding=P(None, "data")), batch)
    zeros = jax.tree.map(jnp.zeros_like, params)
    total, _ = lax.scan(
        lambda acc, mb: (jax.tree.map(jnp.add, acc,
                                      jax.grad(loss)(params, mb)), None),
        zeros, micro)
    return total

  with jax.set_mesh(mesh):
    params, batch = _placed(cfg)
    compiled = jax.jit(naive).lower(params, batch).compile()
  assert helpers.reduction_bytes(compiled, mesh, ("data",))["loop"] > (
      10 * tm.init(tm.Config())["pos"].size * 4)


@pytest.mark.slow
def test_temporary_memory_is_below_the_full_batch():
  cfg = MESHES["data_tensor"][2]
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    ours = jax.jit(oa.value_and_grad(
        tm.loss_fn(cfg), num_microbatches=8, num_tokens_fn=tm.num_tokens,
    )).lower(params, batch).compile().memory_analysis()
    full = jax.jit(jax.value_and_grad(tm.loss_fn(cfg))).lower(
        params, batch).compile().memory_analysis()
  assert ours.temp_size_in_bytes < full.temp_size_in_bytes


@pytest.mark.slow
def test_axis_name_is_read_off_the_batch_and_checked_when_given():
  cfg = MESHES["data_tensor"][2]
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    without = jax.jit(_fn(cfg))(params, batch)
    given = jax.jit(_fn(cfg, axis_name="data"))(params, batch)
    with pytest.raises(ValueError, match=(
        r"axis_name='tensor' does not name the mesh axes that the batch is"
        r" sharded over along its batch axis, \['data'\].*axis_name='data'")):
      jax.jit(_fn(cfg, axis_name="tensor"))(params, batch)
  helpers.assert_trees_equal(without, given)


@pytest.mark.slow
def test_a_replicated_batch_with_axis_name_is_split_without_moving_data():
  cfg = MESHES["data_tensor"][2]
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    got = jax.jit(_fn(cfg, axis_name="data"))(
        params, jax.device_put(batch, P()))
  _close(got, _reference())


@pytest.mark.slow
def test_rng_aux_state_grad_reduction_num_real_and_stats_are_exact():
  """Sections 3-9 in the typed form, against one device's micro-batches."""
  one = tm.on_one_device(tm.Config())
  cfg = MESHES["data_fsdp_tensor"][2]

  def make(cfg):
    base = tm.loss_fn(cfg)

    def loss(params, state, microbatch, *, rng):
      noise = jax.random.normal(rng, ())  # a key per micro-batch
      value = base(params, microbatch) * (1.0 + 0.01 * noise)
      tokens = microbatch["mask"].sum()
      return value, (state + tokens, {
          "tokens": tokens, "value": value, "low": value, "mean": value,
          "rows": microbatch["mask"].sum(-1)})

    return loss

  def fn(cfg, **kwargs):
    return oa.value_and_grad(
        make(cfg), num_microbatches=4, num_tokens_fn=tm.num_tokens,
        has_aux=True, has_state=True, with_stats=True,
        aux_reduction={"tokens": "sum", "value": "max", "low": "min",
                       "mean": "mean", "rows": "stack"},
        grad_reduction={**dict.fromkeys(tm.specs(cfg), "mean"),
                        "final_norm": "max"}, **kwargs)

  key = jax.random.key(3)
  want = jax.jit(fn(one))(tm.init(tm.Config()), jnp.float32(0.0),
                          _blocked(tm.batch(tm.Config(), BATCH), 4),
                          rng=key, num_real_microbatches=3)
  with jax.set_mesh(_mesh("data_fsdp_tensor")):
    params, batch = _placed(cfg)
    got = jax.jit(fn(cfg))(params, jnp.float32(0.0), batch, rng=key,
                           num_real_microbatches=3)
  # The statistics' small batches differ here (each device's rows: SPEC 6;
  # tests/unit/rules/test_noise_scale.py checks them against the brute force).
  _close(got[:2], want[:2])
  assert got[2].num_microbatches > 3


def _blocked(batch, devices):
  """The batch reordered so that one device's contiguous micro-batches are
  the mesh's: micro-batch i of 4 devices is block i of each device's rows."""
  def reorder(x):
    k = 4
    per = x.shape[0] // devices // k
    blocks = x.reshape((devices, k, per) + x.shape[1:])
    return blocks.swapaxes(0, 1).reshape(x.shape)
  return jax.tree.map(reorder, batch)


@pytest.mark.slow
def test_deferred_is_unreduced_over_data_on_a_mesh_with_model_axes():
  cfg = MESHES["data_tensor"][2]
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    loss, grads = jax.jit(_fn(cfg, gradient_sync="deferred"))(params, batch)
    assert {jax.typeof(g).sharding.spec.unreduced
            for g in jax.tree.leaves(grads)} == {frozenset({"data"})}
    summed = jax.jit(lambda g: jax.tree.map(
        lambda x: jax.sharding.reshard(
            x, P(*readers.partitions(jax.typeof(x).sharding.spec))), g))(
                grads)
  _close((loss, summed), _reference())


@pytest.mark.slow
def test_sharding_report_names_the_fallback_leaf_and_its_share():
  cfg = MESHES["data_tensor"][2]
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    report = oa.sharding_report(jax.jit(_fn(cfg)), params, batch)
  one_device = oa.value_and_grad(lambda w, x: jnp.mean(w * x),
                                 num_microbatches=2, equal_weights=True)
  with pytest.raises(ValueError, match="traced no typed micro-batch loop"):
    oa.sharding_report(one_device, jnp.float32(1.0), jnp.ones(4))
  total = sum(x.size * 4 for x in jax.tree.leaves(tm.init(tm.Config())))
  assert report.fallback_leaves == ("params['pos']",)
  assert report.fallback_share == pytest.approx(
      tm.init(tm.Config())["pos"].size * 4 / total)
  assert "jnp.einsum" in report.message()


@pytest.mark.slow
def test_the_fallback_warning_is_given_once(monkeypatch):
  cfg = MESHES["data_tensor"][2]
  reduced_fallbacks._warned.clear()
  # 'pos' adds less than WARN_ABOVE here
  # (tests/unit/microbatch/test_reduced_fallbacks.py).
  monkeypatch.setattr(reduced_fallbacks, "WARN_ABOVE", 0.0)
  with jax.set_mesh(_mesh("data_tensor")):
    params, batch = _placed(cfg)
    with pytest.warns(UserWarning, match=r"params\['pos'\]"):
      jax.jit(_fn(cfg))(params, batch)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      jax.jit(_fn(cfg, num_tokens_fn=lambda mb: mb["mask"].sum()))(
          params, batch)


def test_auto_axes_with_an_annotation_naming_a_data_axis_get_our_error():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def loss(w, mb):
    h = jnp.einsum("bi,io->bo", mb["x"], w, out_sharding=P("data", None))
    return jnp.mean(h ** 2)

  fn = oa.value_and_grad(loss, num_microbatches=2, axis_name="data",
                         equal_weights=True)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=(
        r"(?s)Auto axes.*data axes 'data'.*Explicit")):
      jax.jit(fn)(jnp.ones((4, 3)), {"x": jnp.ones((32, 4))})


def test_a_parameter_outside_the_batch_path_is_kept_replicated_and_exact():
  """``scale * mean(...)``: typed reduced, XLA counted it once per device.

  The loss is then typed reduced and its seed cotangent cast to unreduced,
  which XLA compiled as the value on every device: gradients 8x too large,
  silently. The library finds the cast in the traced loop and keeps the
  leaf replicated.
  """
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 4)).astype(np.float32)

  def loss(p, mb):
    return p["scale"] * jnp.mean(jnp.tanh(mb @ p["w"]) ** 2)

  params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            "scale": jnp.float32(2.0)}
  want = jax.grad(loss)(params, x)
  with jax.set_mesh(_mesh("fsdp")):
    with reduced_fallbacks.collecting() as reports:
      _, got = jax.jit(oa.value_and_grad(loss, num_microbatches=2,
                                         equal_weights=True))(
          params, jax.device_put(x, P("fsdp")))
  _close(got, want)
  assert reports[-1].fallback_leaves == ("params['scale']",)


_ABORTING_GATHER = """
import jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import AxisType, PartitionSpec as P
import optax_accum as oa
mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                     axis_types=(AxisType.Explicit,) * 3)
def loss(p, mb):  # the rows of a table split over "tensor", gathered whole
  x = p["table"].at[mb["ids"]].get(out_sharding=P())
  return jnp.mean(jnp.tanh(x))
with jax.set_mesh(mesh):
  table = jax.device_put(jnp.ones((16, 8)), P("tensor", "fsdp"))
  ids = jax.device_put(jnp.zeros((8, 3), jnp.int32), P(("data", "fsdp")))
  fn = oa.value_and_grad(loss, num_microbatches=2, equal_weights=True)
  _, grads = jax.jit(fn)({"table": table}, {"ids": ids})
  want = jax.jit(jax.grad(loss))({"table": table}, {"ids": ids})
  print(float(abs(grads["table"] - want["table"]).max()))
"""


@pytest.mark.slow
def test_a_cast_that_xla_aborts_on_is_kept_replicated(tmp_path):
  """Shardy aborted the process compiling this reduced table's gradient."""
  script = tmp_path / "gather.py"
  script.write_text(_ABORTING_GATHER)
  env = dict(os.environ, PYTHONWARNINGS="ignore")
  out = subprocess.run([sys.executable, str(script)], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert float(out.stdout.split()[-1]) < 1e-6  # the full batch's gradient.


@pytest.mark.slow
def test_with_the_positions_broadcast_no_gradient_is_reduced_in_the_loop():
  """The same decoder, its positional add written for reduced types."""
  cfg = MESHES["data_tensor"][2]._replace(pos_broadcast=True)
  mesh = _mesh("data_tensor")
  with jax.set_mesh(mesh):
    params, batch = _placed(cfg)
    step = jax.jit(_fn(cfg))
    with reduced_fallbacks.collecting() as reports:
      got = step(params, batch)
    compiled = step.lower(params, batch).compile()
  _close(got, _reference())
  assert reports[-1].fallback_leaves == ()
  assert helpers.reduction_bytes(compiled, mesh, ("data",))["loop"] == 0


def test_loss_fn_is_traced_once_when_no_leaf_falls_back():
  """The cast check reads the jaxpr of the one trace, evaluated in place."""
  name = "data_tensor"
  cfg = MESHES[name][2]._replace(pos_broadcast=True)
  base, calls = tm.loss_fn(cfg), []

  def loss(params, microbatch):
    calls.append(None)
    return base(params, microbatch)

  fn = oa.value_and_grad(loss, num_microbatches=K, num_tokens_fn=tm.num_tokens)
  with jax.set_mesh(_mesh(name)):
    params, batch = _placed(cfg)
    with reduced_fallbacks.collecting() as reports:
      jax.jit(fn).trace(params, batch)
  assert reports[-1].fallback_leaves == ()
  assert len(calls) == 1


@pytest.mark.slow  # 26 s: two typed programs on 8 devices.
def test_scanned_layers_give_the_unrolled_loss_and_gradients():
  """``scan_layers=True``: the same draws stacked, the blocks in a scan."""
  cfg = MESHES["data_tensor"][2]._replace(pos_broadcast=True,
                                           scan_layers=True)
  with jax.set_mesh(_mesh("data_tensor")):
    params = jax.tree.map(jax.device_put, tm.init(cfg), tm.specs(cfg))
    batch = jax.device_put(tm.batch(cfg, BATCH), P(cfg.batch_axes))
    loss, grads = jax.jit(_fn(cfg))(params, batch)
  want_loss, want = _reference()
  want["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *want["layers"])
  _close((loss, grads), (want_loss, want))
