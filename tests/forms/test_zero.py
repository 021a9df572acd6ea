"""ZeRO-1 and ZeRO-2 (SPEC 12): the optimizer sharded over the data axes.

Both entry points, against the full batch (uneven tokens, adamw with a
schedule and global-norm clipping), on 8 simulated devices and on a data x
tensor mesh; the compiled programs' collectives; the state's shards (1/N);
a mid-window checkpoint; what is refused and why.
"""

import inspect

from flax import nnx
from flax.nnx.training import optimizer as flax_optimizer
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.compiled import hlo

pytestmark = pytest.mark.skipif(
    not hasattr(P(), "unreduced") or not hasattr(jax.sharding, "reshard"),
    reason="unreduced sharding types need jax >= 0.9.1")

N, K, UPDATES = 8, 4, 2


def _mesh(shape=(N,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(
      shape))


def _params():
  rng = np.random.default_rng(0)
  return {
      "w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(32,)) * 0.3, jnp.float32),
      "odd": jnp.asarray(rng.normal(size=(3,)), jnp.float32),  # no shard.
  }


def _loss(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  pred = hidden @ params["w2"] + jnp.sum(params["odd"])
  err = batch["mask"] * (pred - batch["y"]) ** 2
  return err.sum() / jnp.maximum(batch["mask"].sum(), 1.0)


def _micro_batches(rows=2 * N):
  rng = np.random.default_rng(1)
  out = []
  for i in range(K * UPDATES):
    mask = (rng.random(rows) < rng.uniform(0.1, 0.9)).astype(np.float32)
    if i == 1:
      mask[:] = 0.0  # an empty micro-batch.
    out.append({"x": jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(rows,)), jnp.float32),
                "mask": jnp.asarray(mask)})
  return out


def _optimizer():
  return helpers.clipped_adamw(UPDATES)


def _full_batch(micro_batches):
  params, opt = _params(), _optimizer()
  state = opt.init(params)
  for u in range(UPDATES):
    window = micro_batches[u * K:(u + 1) * K]
    whole = jax.tree.map(lambda *x: jnp.concatenate(x), *window)
    updates, state = opt.update(jax.grad(_loss)(params, whole), state, params)
    params = optax.apply_updates(params, updates)
  return params


def _tokens(batch):
  return batch["mask"].sum()


def _shard_size(x):
  return x.addressable_shards[0].data.size


def test_zero_specs_shard_one_dimension_over_the_data_axes():
  mesh = _mesh((4, 2), ("data", "tensor"))
  with jax.set_mesh(mesh):
    tree = {
        "w": jax.device_put(jnp.zeros((8, 6)), P(None, "tensor")),
        "fsdp": jax.device_put(jnp.zeros((8, 2)), P("data")),
        "bias": jnp.zeros(6), "scale": jnp.zeros([]),
        "v": jnp.zeros((6, 12)),
    }
    specs = oa.zero_specs(tree, "data")
  assert specs == {"w": P("data", "tensor"), "fsdp": P("data"),
                   "bias": P(), "scale": P(), "v": P(None, "data")}
  with jax.set_mesh(mesh):
    specs = oa.zero_specs({"w": jnp.zeros((8, 3))}, ("data", "tensor"))
  assert specs == {"w": P(("data", "tensor"))}


def test_zero_specs_name_a_missing_mesh_and_unknown_axes():
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    oa.zero_specs({"w": jnp.zeros(8)}, "data")
  with pytest.raises(ValueError, match="'batch'"):
    oa.zero_specs({"w": jnp.zeros(8)}, "batch", mesh=_mesh())
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh"):
    oa.zero_specs({"w": jnp.zeros(8)}, "data", mesh="data")


@pytest.mark.parametrize("sync", ["once", "every_microbatch"])
@pytest.mark.slow
def test_value_and_grad_zero_matches_the_full_batch(sync):
  micro_batches = _micro_batches()
  opt = _optimizer()
  grad_fn = oa.value_and_grad(_loss, num_microbatches=K,
                              num_tokens_fn=_tokens, gradient_sync=sync,
                              param_specs=None)
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    specs = oa.zero_specs(params, "data")
    grad_fn = oa.value_and_grad(_loss, num_microbatches=K,
                                num_tokens_fn=_tokens, gradient_sync=sync,
                                param_specs=specs)
    opt_state = jax.jit(opt.init)(jax.sharding.reshard(params, specs))

    @jax.jit
    def step(params, opt_state, batch):
      _, grads = grad_fn(params, batch)  # sharded like specs.
      updates, opt_state = opt.update(
          grads, opt_state, jax.sharding.reshard(params, specs))
      updates = jax.tree.map(jax.sharding.reshard, updates,
                             jax.tree.map(lambda _: P(), updates))
      return optax.apply_updates(params, updates), opt_state

    batch0 = jax.tree.map(lambda *x: jnp.concatenate(x), *micro_batches[:K])
    compiled = step.lower(params, opt_state,
                          jax.device_put(batch0, P("data"))).compile()
    for u in range(UPDATES):
      batch = jax.tree.map(lambda *x: jnp.concatenate(x),
                           *micro_batches[u * K:(u + 1) * K])
      params, opt_state = step(params, opt_state,
                               jax.device_put(batch, P("data")))
    mu = opt_state[1][0].mu
  helpers.assert_trees_close(jax.device_get(params), _full_batch(
      micro_batches), rtol=2e-5, atol=1e-6)
  assert _shard_size(mu["w1"]) == 16 * 32 // N
  assert _shard_size(mu["odd"]) == 3  # replicated: 3 does not divide by 8.
  counts = oa.count_collectives(compiled, include_scalars=False)
  assert "all-reduce" not in counts.total  # no gradient-sized all-reduce.
  assert counts.outside.get("all-gather") == 2  # w1's and w2's updates.
  where = counts.in_loop if sync == "every_microbatch" else counts.outside
  assert where.get("reduce-scatter") == 2
  oa.check_train_step(compiled, num_microbatches=K, gradient_sync=sync)


def _micro_step(tx, fused=False):
  """One jit call per micro-batch: a deferred gradient, then tx.update (or
  oa.update_and_apply, with ``fused``)."""
  grad_fn = oa.value_and_grad(_loss, num_microbatches=1,
                              num_tokens_fn=_tokens, gradient_sync="deferred")

  @jax.jit
  def micro_step(params, state, batch):
    _, grads = grad_fn(params, batch)
    if fused:
      return oa.update_and_apply(tx, grads, state, params,
                                 num_tokens=_tokens(batch))
    updates, state = tx.update(grads, state, params,
                               num_tokens=_tokens(batch))
    return oa.apply_if_updated(params, updates, state), state

  return micro_step


def _accumulate_run(tx, micro_batches, mesh, fused=False):
  micro_step = _micro_step(tx, fused)

  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), P())
    state = jax.jit(tx.init)(params)
    first = jax.device_put(micro_batches[0], P("data"))
    compiled = micro_step.lower(params, state, first).compile()
    for batch in micro_batches:
      params, state = micro_step(params, state,
                                 jax.device_put(batch, P("data")))
  return params, state, compiled


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.parametrize("sync", ["once", "every_microbatch"])
@pytest.mark.slow
def test_accumulate_zero_matches_the_full_batch(sync):
  micro_batches = _micro_batches()
  tx = oa.accumulate(_optimizer(), K, shard_optimizer="data",
                     gradient_sync=sync)
  params, state, compiled = _accumulate_run(tx, micro_batches, _mesh())
  helpers.assert_trees_close(jax.device_get(params), _full_batch(
      micro_batches), rtol=2e-5, atol=1e-6)
  # Still replicated.
  assert all(e is None for e in jax.typeof(params["w1"]).sharding.spec)
  mu = state.inner_state[1][0].mu
  assert _shard_size(mu["w1"]) == 16 * 32 // N
  expected_sum = 16 * 32 // N if sync == "every_microbatch" else 16 * 32
  if sync == "every_microbatch":
    assert _shard_size(state.grad_sum["w1"]) == expected_sum
  counts = oa.count_collectives(compiled, include_scalars=False)
  # One all-reduce at most: of "odd" (12 bytes), which stays replicated
  # (on emit for ZeRO-1, every call for ZeRO-2, as the docs say).
  assert counts.total.get("all-reduce", 0) <= 1
  assert counts.in_branch.get("all-gather") == 2
  if sync == "once":
    assert counts.in_branch.get("reduce-scatter") == 2
    assert "reduce-scatter" not in counts.outside
  else:
    assert counts.outside.get("reduce-scatter") == 2
  oa.check_train_step(compiled, num_microbatches=1, gradient_sync=sync)


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.parametrize("shard_optimizer", [None, "data"])
@pytest.mark.slow
def test_update_and_apply_matches_the_full_batch(shard_optimizer):
  """The updates applied in the emitting branch: the deferred typed form,
  and ZeRO-1 (whose branch gathers the updates, then applies them)."""
  micro_batches = _micro_batches()
  tx = oa.accumulate(_optimizer(), K, shard_optimizer=shard_optimizer)
  params, _, _ = _accumulate_run(tx, micro_batches, _mesh(), fused=True)
  helpers.assert_trees_close(jax.device_get(params), _full_batch(
      micro_batches), rtol=2e-5, atol=1e-6)
  assert all(e is None for e in jax.typeof(params["w1"]).sharding.spec)


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.slow
def test_accumulate_zero_on_a_data_by_tensor_mesh():
  mesh = _mesh((4, 2), ("data", "tensor"))
  micro_batches = _micro_batches(rows=8)
  tx = oa.accumulate(_optimizer(), K, shard_optimizer="data")
  micro_step = _micro_step(tx)

  with jax.set_mesh(mesh):
    params = _params()
    params = {**params, "w1": jax.device_put(params["w1"], P(None, "tensor"))}
    params = jax.device_put(params, {"w1": P(None, "tensor"), "w2": P(),
                                     "odd": P()})
    state = jax.jit(tx.init)(params)
    assert jax.typeof(state.inner_state[1][0].mu["w1"]).sharding.spec == (
        P("data", "tensor"))
    for batch in micro_batches:
      params, state = micro_step(params, state,
                                 jax.device_put(batch, P("data")))
    assert tuple(jax.typeof(params["w1"]).sharding.spec) == (None, "tensor")
  helpers.assert_trees_close(jax.device_get(params), _full_batch(
      micro_batches), rtol=2e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:1 parameter leaves cannot be typed")
@pytest.mark.slow
def test_accumulate_zero2_resumes_mid_window_from_a_checkpoint(tmp_path):
  micro_batches = _micro_batches()
  tx = oa.accumulate(_optimizer(), K, shard_optimizer="data",
                     gradient_sync="every_microbatch")
  micro_step = _micro_step(tx)

  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    state = jax.jit(tx.init)(params)
    for batch in micro_batches[:K + 1]:  # one update, one micro-step more.
      params, state = micro_step(params, state,
                                 jax.device_put(batch, P("data")))
    saved = jax.jit(oa.reduced_state)(state)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", saved)
      checkpointer.wait_until_finished()
      restored = checkpointer.restore(tmp_path / "ckpt", saved)
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(
        lambda x: x.sharding, saved)
    assert _shard_size(restored.grad_sum["w1"]) == 16 * 32 // N
    resumed_params, resumed = params, restored
    for batch in micro_batches[K + 1:]:
      batch = jax.device_put(batch, P("data"))
      params, state = micro_step(params, state, batch)
      resumed_params, resumed = micro_step(resumed_params, resumed, batch)
  helpers.assert_trees_close(resumed_params, params, rtol=1e-6)


def test_muon_on_shards_is_refused_with_our_note():
  tx = oa.accumulate(optax.contrib.muon(1e-2), 2, shard_optimizer="data")
  with jax.set_mesh(_mesh()):
    params = jax.device_put({"w": jnp.ones((16, 8))}, P())
    state = jax.jit(tx.init)(params)
    with pytest.raises(Exception, match="Contracting dimensions") as e:
      jax.jit(tx.update)({"w": jnp.ones((16, 8))}, state, params)
  assert "Muon" in "".join(getattr(e.value, "__notes__", []))


def test_bad_zero_arguments_are_named():
  with pytest.raises(ValueError, match="pass shard_optimizer too"):
    oa.accumulate(optax.sgd(0.1), 2, gradient_sync="every_microbatch")
  with pytest.raises(ValueError, match="gradient_sync must be one of"):
    oa.accumulate(optax.sgd(0.1), 2, shard_optimizer="data",
                  gradient_sync="deferred")
  with pytest.raises(ValueError, match="leave axis_name out"):
    oa.accumulate(optax.sgd(0.1), 2, shard_optimizer="data",
                  axis_name="data")
  tx = oa.accumulate(optax.sgd(0.1), 2, shard_optimizer="data")
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    tx.init({"w": jnp.zeros(8)})


def test_the_planner_plans_zero_steps():
  """param_specs=zero_specs makes the FSDP policies apply: ZeRO-1 ("once")
  moves fewest collectives, and fits, so it is chosen without compiling
  ZeRO-2 (which the planner tries when it does not fit)."""
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(jax.tree.map(
        lambda *x: jnp.concatenate(x), *_micro_batches()[:K]), P("data"))
    plan = oa.plan_microbatches(
        _loss, params, batch, memory_budget=2**30, candidates=[2],
        num_tokens_fn=_tokens, param_specs=oa.zero_specs(params, "data"))
  assert (plan.num_microbatches, plan.gradient_sync) == (2, "once")
  assert [c.gradient_sync for c in plan.table] == ["once"]


def test_sharding_report_names_the_leaves_zero_keeps_whole():
  """SPEC 12 item 4: "odd" (3 floats) has no dimension that 8 divides; the
  report and its message name it, and only it."""
  with jax.set_mesh(_mesh()):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(jax.tree.map(
        lambda *x: jnp.concatenate(x), *_micro_batches()[:K]), P("data"))
    grad_fn = oa.value_and_grad(
        _loss, num_microbatches=K, num_tokens_fn=_tokens,
        param_specs=oa.zero_specs(params, "data"))
    report = oa.sharding_report(jax.jit(grad_fn), params, batch)
    plain = oa.sharding_report(jax.jit(oa.value_and_grad(
        _loss, num_microbatches=K, num_tokens_fn=_tokens)), params, batch)
  assert report.whole_leaves == ("params['odd']",)
  assert report.whole_bytes == 3 * 4
  assert not {"params['w1']", "params['w2']"} & set(report.whole_leaves)
  assert "param_specs= keeps 1 parameter leaves whole over ['data']" in (
      report.message())
  assert "params['odd'] (12 bytes" in report.message()
  assert "their optimizer state is held whole on every device" in (
      report.message())
  # Without param_specs nothing is kept whole on purpose: nothing is said.
  assert plain.whole_leaves == () and "param_specs=" not in plain.message()


class _NnxModel(nnx.Module):
  """``_params()`` as Params whose ``optimizer_sharding`` shards adamw's
  moments over 'data' (``odd``'s 3 do not divide by 8: whole)."""

  def __init__(self, optimizer_sharding=True):
    p = _params()
    shard = (lambda spec: {"optimizer_sharding": spec}) if (
        optimizer_sharding) else (lambda spec: {})
    self.w1 = nnx.Param(p["w1"], **shard(P("data", None)))
    self.w2 = nnx.Param(p["w2"], **shard(P("data")))
    self.odd = nnx.Param(p["odd"])


def _nnx_values(model):
  return {"w1": model.w1[...], "w2": model.w2[...], "odd": model.odd[...]}


def _nnx_loss(model_or_state, batch):
  """``_loss`` of a model, or of its State of Params."""
  return _loss({k: getattr(model_or_state, k)[...]
                for k in ("w1", "w2", "odd")}, batch)


def _nnx_deferred_step(traces):
  """One nnx.jit call per micro-batch: a gradient_sync="deferred" gradient
  into optimizer.update; ``traces`` counts the traces."""
  grad_fn = oa.value_and_grad(_nnx_loss, num_microbatches=1,
                              num_tokens_fn=_tokens, gradient_sync="deferred")

  @nnx.jit
  def micro_step(model, optimizer, batch):
    traces.append(None)
    _, grads = grad_fn(nnx.state(model, nnx.Param), batch)
    optimizer.update(model, grads, num_tokens=_tokens(batch))

  return micro_step


def _sum_types(optimizer):
  return jax.tree.map(lambda x: str(jax.typeof(x)),
                      nnx.as_pure(optimizer.opt_state.grad_sum))


needs_optimizer_sharding = pytest.mark.skipif(
    "optimizer_sharding" not in inspect.getsource(flax_optimizer),
    reason="this flax's nnx.Optimizer reads no optimizer_sharding")


@needs_optimizer_sharding
@pytest.mark.slow
def test_nnx_optimizer_sharding_metadata_makes_a_zero_state():
  """SPEC 12: Variables carrying Flax's ``optimizer_sharding`` give adamw
  sharded state (no argument of ours); each update's gradient-sized updates
  are gathered back to the replicated parameters in the emitting branch, and
  training matches the full batch. The running sum is whole (ZeRO-1), each
  device's partial, from ``init`` on."""
  micro_batches = _micro_batches()
  with jax.set_mesh(_mesh()):
    model = _NnxModel()
    optimizer = nnx.Optimizer(model, oa.accumulate(_optimizer(), K),
                              wrt=nnx.Param)
    at_init = _sum_types(optimizer)

    @nnx.jit
    def micro_step(model, optimizer, batch):
      optimizer.update(model, nnx.grad(_nnx_loss)(model, batch),
                       num_tokens=_tokens(batch))

    for batch in micro_batches:
      micro_step(model, optimizer, jax.device_put(batch, P("data")))
    mu = optimizer.opt_state.inner_state[1][0].mu
    assert _shard_size(mu["w1"][...]) == 16 * 32 // N
    assert _sum_types(optimizer) == at_init
    assert at_init["w1"] == "float32[16,32]{U:data}"
    assert all(e is None for e in jax.typeof(model.w1[...]).sharding.spec)
    got = _nnx_values(model)
  helpers.assert_trees_close(jax.device_get(got), _full_batch(micro_batches),
                             rtol=2e-5, atol=1e-6)


def _nnx_emit_collectives(optimizer_sharding, **zero):
  """The gradient-sized collectives (kind, result bytes) of the per-call
  step in its emitting branch and outside it, and the sum's types after
  init and after a call."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    model = _NnxModel(optimizer_sharding)
    optimizer = nnx.Optimizer(model, oa.accumulate(_optimizer(), K, **zero),
                              wrt=nnx.Param)
    at_init = _sum_types(optimizer)
    step = _nnx_deferred_step([])
    batch = jax.device_put(_micro_batches()[0], P("data"))
    compiled = step.lower(model, optimizer, batch).compile()
    step(model, optimizer, batch)
    after = _sum_types(optimizer)
  found = [c for c in hlo.collectives(compiled, mesh) if not c.scalar]
  emit = sorted((c.collective, c.nbytes) for c in found if c.branched)
  outside = sorted((c.collective, c.nbytes) for c in found
                   if not c.branched)
  return emit, outside, (at_init, after)


@needs_optimizer_sharding
@pytest.mark.slow
def test_nnx_optimizer_sharding_with_deferred_gradients_is_zero1():
  """Issue 50 item 1, read from the compiled program: one reduce-scatter per
  sharded leaf into adamw's shards on emit (only ``odd``'s 12 bytes are
  all-reduced), one all-gather of its updates, nothing gradient-sized on the
  other calls; the running sum's type is the same after init and after a
  call (before: sharded, then whole and unreduced)."""
  emit, outside, (at_init, after) = _nnx_emit_collectives(True)
  assert emit == [("all-gather", 32 * 4), ("all-gather", 16 * 32 * 4),
                  ("all-reduce", 3 * 4), ("reduce-scatter", 32 // N * 4),
                  ("reduce-scatter", 16 * 32 // N * 4)]
  assert not outside
  assert after == at_init
  assert at_init == {"odd": "float32[3]{U:data}",
                     "w1": "float32[16,32]{U:data}",
                     "w2": "float32[32]{U:data}"}
  # Negative control: without optimizer_sharding the gradient is
  # all-reduced whole (one tuple all-reduce of every leaf).
  emit, _, _ = _nnx_emit_collectives(False)
  assert emit == [("all-reduce", (3 + 16 * 32 + 32) * 4)]


@needs_optimizer_sharding
@pytest.mark.slow
def test_nnx_optimizer_sharding_zero2_scatters_each_call_into_the_sum():
  """ZeRO-2 as docs/zero.md says (shard_optimizer and gradient_sync=
  "every_microbatch" on oa.accumulate) with the same Variables: each call
  reduce-scatters into the sharded sum, the emit all-reduces ``odd`` only;
  the sum's type is the same after init and after a call."""
  emit, outside, (at_init, after) = _nnx_emit_collectives(
      True, shard_optimizer="data", gradient_sync="every_microbatch")
  assert outside == [("reduce-scatter", 32 // N * 4),
                     ("reduce-scatter", 16 * 32 // N * 4)]
  assert emit == [("all-gather", 32 * 4), ("all-gather", 16 * 32 * 4),
                  ("all-reduce", 3 * 4)]
  assert after == at_init
  assert at_init == {"odd": "float32[3]{U:data}",
                     "w1": "float32[16@data,32]", "w2": "float32[32@data]"}


@needs_optimizer_sharding
@pytest.mark.parametrize("zero", [
    {}, {"shard_optimizer": "data", "gradient_sync": "every_microbatch"}])
@pytest.mark.slow
def test_nnx_optimizer_sharding_with_deferred_gradients_matches_the_full_batch(
    zero):
  """The same per-call loop (ZeRO-1, and ZeRO-2), two updates of uneven
  tokens (an empty micro-batch): the full batch's parameters, adamw's
  moments in 1/N, one trace of the step for every call."""
  micro_batches = _micro_batches()
  traces = []
  with jax.set_mesh(_mesh()):
    model = _NnxModel()
    optimizer = nnx.Optimizer(model, oa.accumulate(_optimizer(), K, **zero),
                              wrt=nnx.Param)
    step = _nnx_deferred_step(traces)
    for batch in micro_batches:
      step(model, optimizer, jax.device_put(batch, P("data")))
    mu = optimizer.opt_state.inner_state[1][0].mu
    assert _shard_size(mu["w1"][...]) == 16 * 32 // N
    got = _nnx_values(model)
  assert len(traces) == 1
  helpers.assert_trees_close(jax.device_get(got), _full_batch(micro_batches),
                             rtol=2e-5, atol=1e-6)


def test_a_state_from_another_layout_is_named():
  """Issue 50 item 3: a replicated state (an old checkpoint) fed to a ZeRO-1
  update: our error naming the leaf and tx.init, not JAX's "cond branches
  must have equal output types"."""
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), P())
    zero = oa.accumulate(_optimizer(), K, shard_optimizer="data")
    old = oa.accumulate(_optimizer(), K).init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with pytest.raises(ValueError, match=r"state\.inner_state.*another"
                       r" layout.*tx\.init\(params\) under the same mesh"):
      jax.jit(lambda g, s, p: zero.update(g, s, p, num_tokens=4))(
          grads, old, params)
