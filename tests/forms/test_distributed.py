"""Data parallelism: one reduction per optimizer update, read from the HLO.

Every case compares against the single-device full-batch gradient (uneven
token counts) and counts the collectives of the compiled program with
``oa.count_collectives``: none inside the micro-batch loop, and with
``oa.accumulate`` none outside its emitting branch. The naive loops and
``optax.MultiSteps`` are counted next to ours for comparison.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

N = 8  # simulated devices (tests/conftest.py).
K = 2  # micro-batches per device and step.
BATCH, SEQ, DIM = 32, 4, 8


def _data(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, SEQ + 1, size=BATCH)
  lengths[:4] = [0, 4, 1, 0]  # a micro-batch with no tokens on device 0.
  batch = helpers.padded_batch(rng, lengths, SEQ, DIM)
  return jax.tree.map(jnp.asarray, batch)


def _params():
  return helpers.linear_params(DIM)


def mean_loss(params, batch):
  return helpers.safe_mean(
      helpers.linear_token_losses(params, batch), batch
  )


num_tokens = helpers.num_tokens


def _expected():
  return jax.value_and_grad(mean_loss)(_params(), _data())


def _assert_matches_full_batch(loss, grads):
  expected_loss, expected_grads = _expected()
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
  helpers.assert_trees_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def _fn(**kwargs):
  return oa.value_and_grad(
      mean_loss, num_microbatches=K, num_tokens_fn=num_tokens, **kwargs
  )


def _mesh(axis_type=AxisType.Explicit, shape=(N,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _naive_scan(params, batch):
  """A lax.scan of jax.grad over micro-batches, reduced by whatever JAX does."""
  split = jax.tree.map(
      lambda x: x.reshape((-1, K) + x.shape[1:]).swapaxes(0, 1), batch
  )

  def step(grad_sum, microbatch):
    grads = jax.grad(mean_loss)(params, microbatch)
    return jax.tree.map(jnp.add, grad_sum, grads), None

  grad_sum, _ = jax.lax.scan(step, jax.tree.map(jnp.zeros_like, params), split)
  return grad_sum


def _per_device(tree):
  return jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), tree)


# value_and_grad inside shard_map and pmap.


@pytest.mark.slow
def test_value_and_grad_in_shard_map_reduces_once_after_the_loop():
  mesh = _mesh(AxisType.Auto)
  fn = jax.jit(jax.shard_map(
      _fn(axis_name="data"), mesh=mesh, in_specs=(P(), P("data")),
      out_specs=P(),
  ))
  params, batch = _params(), _data()
  _assert_matches_full_batch(*fn(params, batch))
  counts = oa.count_collectives(fn.lower(params, batch).compile())
  assert counts.in_loop == {}
  assert counts.total == {"all-reduce": 1}

  # For comparison: grad of replicated params is psummed by autodiff on
  # every micro-step.
  naive = jax.jit(jax.shard_map(
      _naive_scan, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
  ))
  assert oa.count_collectives(naive.lower(params, batch).compile()).in_loop


@pytest.mark.slow
def test_value_and_grad_in_pmap_reduces_once_after_the_loop():
  fn = jax.pmap(_fn(axis_name="data"), axis_name="data", in_axes=(None, 0))
  params, batch = _params(), _per_device(_data())
  loss, grads = fn(params, batch)
  _assert_matches_full_batch(loss[0], jax.tree.map(lambda g: g[0], grads))
  np.testing.assert_array_equal(loss, loss[0])  # every device agrees.
  counts = oa.count_collectives(fn.lower(params, batch).compile())
  assert counts.in_loop == {}
  assert counts.total == {"all-reduce": 1}


def test_value_and_grad_inside_shard_map_threads_model_state():
  def loss_fn(params, model_state, batch):
    model_state = 0.5 * model_state + 0.5 * batch["x"].mean()
    return mean_loss(params, batch), model_state

  fn = oa.value_and_grad(
      loss_fn, num_microbatches=K, num_tokens_fn=num_tokens, has_state=True,
      axis_name="data",
  )
  mesh = _mesh(AxisType.Auto)
  sharded = jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
  ))
  (loss, model_state), grads = sharded(_params(), jnp.float32(0.0), _data())
  _assert_matches_full_batch(loss, grads)
  # Each device's running average, then their mean over devices.
  x = np.asarray(_data()["x"]).reshape(N, K, -1).mean(-1)
  expected = (0.25 * x[:, 0] + 0.5 * x[:, 1]).mean()
  np.testing.assert_allclose(model_state, expected, rtol=1e-5, atol=1e-6)


# value_and_grad under jit with the batch sharded over a mesh axis.


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.slow
def test_value_and_grad_under_jit_reduces_once_after_the_loop(axis_type):
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), P())
    batch = jax.device_put(_data(), P("data"))
    fn = jax.jit(_fn(axis_name="data"))
    _assert_matches_full_batch(*fn(params, batch))
    # With Explicit axes the loss's scalars are reduced in the loop (its sum
    # over the global micro-batch): count the gradient-sized collectives.
    counts = oa.count_collectives(fn.lower(params, batch).compile(),
                                  include_scalars=False)
    naive = oa.count_collectives(
        jax.jit(_naive_scan).lower(params, batch).compile(),
        include_scalars=False)
  assert counts.in_loop == {}
  assert counts.total == {"all-reduce": 1}
  assert naive.in_loop["all-reduce"] >= 1  # each runs once per micro-batch.


@pytest.mark.slow
def test_value_and_grad_under_jit_with_fsdp_params_reduce_scatters():
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), {"w": P("data"), "b": P()})
    batch = jax.device_put(_data(), P("data"))
    fn = jax.jit(_fn(axis_name="data"))
    loss, grads = fn(params, batch)
    counts = oa.count_collectives(fn.lower(params, batch).compile(),
                                  include_scalars=False)
  _assert_matches_full_batch(loss, grads)
  assert grads["w"].sharding.spec == P("data")  # in the params' sharding.
  assert counts.in_loop == {}
  # The parameter is gathered once before the loop; the gradient is
  # reduce-scattered into its shards once after it.
  assert counts.outside == {"all-gather": 1, "reduce-scatter": 1}


def test_value_and_grad_under_jit_returns_aux_and_model_state():
  def loss_fn(params, model_state, batch):
    model_state = model_state + batch["x"].mean()
    per_example = batch["mask"].sum(-1)
    return mean_loss(params, batch), (model_state, (per_example, 1.0))

  fn = oa.value_and_grad(
      loss_fn, num_microbatches=K, num_tokens_fn=num_tokens, has_state=True,
      has_aux=True, axis_name="data",
  )
  with jax.set_mesh(_mesh(AxisType.Auto)):  # loss_fn sees a device's slice.
    (loss, (model_state, (per_example, ones))), grads = jax.jit(fn)(
        jax.device_put(_params(), P()), jnp.float32(0.0),
        jax.device_put(_data(), P("data")),
    )
  _assert_matches_full_batch(loss, grads)
  # Micro-batch i is made of every device's i-th slice, in device order.
  tokens = np.asarray(_data()["mask"]).sum(-1).reshape(N, K, -1)
  np.testing.assert_array_equal(
      per_example, tokens.swapaxes(0, 1).reshape(K, -1)
  )
  np.testing.assert_array_equal(ones, np.ones((K, N)))
  x = np.asarray(_data()["x"]).reshape(N, K, -1).mean(-1)
  np.testing.assert_allclose(model_state, x.sum(1).mean(), rtol=1e-5,
                             atol=1e-6)


def test_value_and_grad_names_the_problem_with_the_axis_or_batch():
  fn = _fn(axis_name="data")
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    jax.jit(fn)(_params(), _data())
  with jax.set_mesh(_mesh(AxisType.Auto)):
    with pytest.raises(ValueError, match=r"24 .* 2 \* 8"):
      jax.jit(fn)(_params(), jax.tree.map(lambda x: x[:24], _data()))


# accumulate inside shard_map and pmap.


def _reference_trajectory(inner, steps):
  """Full-batch updates: each optimizer update sees K * N micro-batches."""
  params = _params()
  state = inner.init(params)
  for _ in range(steps):
    grads = jax.grad(mean_loss)(params, _data())
    updates, state = inner.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _shard_map_step(tx, fused=False):
  def step(params, state, batch):
    grads = jax.grad(mean_loss)(oa.device_local(params, "data"), batch)
    if fused:  # applied in the emitting branch.
      return oa.update_and_apply(tx, grads, state, params,
                                 num_tokens=num_tokens(batch))
    updates, state = tx.update(
        grads, state, params, num_tokens=num_tokens(batch)
    )
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("axis_type,fused", [
    (AxisType.Explicit, False), (AxisType.Auto, False),
    (AxisType.Explicit, True)])
@pytest.mark.slow
def test_accumulate_in_shard_map_reduces_only_in_the_emitting_branch(
    axis_type, fused,
):
  inner = optax.sgd(0.5, momentum=0.9)  # scale-sensitive, unlike adam.
  tx = oa.accumulate(inner, every_k=K, axis_name="data")
  with jax.set_mesh(_mesh(axis_type)):
    params = jax.device_put(_params(), P())
    state = tx.init(params)  # one slot per device, sharded over the axis.
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(
        _shard_map_step(tx, fused), in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs),
    ))
    # Micro-step i of a cycle: every device's i-th slice of the batch.
    microbatches = [
        jax.device_put(jax.tree.map(
            lambda x, i=i: x.reshape((N, K, -1) + x.shape[1:])[:, i].reshape(
                (-1,) + x.shape[1:]), _data()), P("data"))
        for i in range(K)
    ]
    for _ in range(2):
      for microbatch in microbatches:
        params, state = step(params, state, microbatch)
    counts = oa.count_collectives(
        step.lower(params, state, microbatches[0]).compile()
    )
  helpers.assert_trees_close(
      params, _reference_trajectory(inner, 2), rtol=1e-5, atol=1e-6
  )
  assert counts.total == counts.in_branch == {"all-reduce": 1}


def test_accumulate_in_shard_map_initialised_inside_it():
  tx = oa.accumulate(optax.sgd(1.0), every_k=1, axis_name="data")

  def step(params, batch):
    state = tx.init(params)  # this device's slot, invariant until updated.
    params, _ = _shard_map_step(tx)(params, state, batch)
    return params

  mesh = _mesh(AxisType.Auto)
  params = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
  ))(_params(), _data())
  _, grads = _expected()
  helpers.assert_trees_close(
      params, jax.tree.map(lambda p, g: p - g, _params(), grads),
      rtol=1e-5, atol=1e-6,
  )


@pytest.mark.slow
def test_accumulate_in_shard_map_skips_one_devices_nonfinite_micro_step():
  tx = oa.accumulate(
      optax.sgd(1.0), every_k=1, axis_name="data", skip_nonfinite=True
  )
  data = _data()
  # Device 3 sees a NaN: its micro-batch is dropped, the others count.
  poisoned = dict(data, x=data["x"].at[12].set(jnp.nan))
  kept = jax.tree.map(
      lambda x: jnp.concatenate([x[:12], x[16:]]), data
  )
  with jax.set_mesh(_mesh(AxisType.Auto)):
    params = _params()
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(
        _shard_map_step(tx), in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs),
    ))
    params, state = step(params, state, poisoned)
  _, grads = jax.value_and_grad(mean_loss)(_params(), kept)
  helpers.assert_trees_close(
      params, jax.tree.map(lambda p, g: p - g, _params(), grads),
      rtol=1e-5, atol=1e-6,
  )
  np.testing.assert_array_equal(state.nonfinite_count, np.eye(N)[3])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.slow
def test_accumulate_in_pmap_reduces_only_in_the_emitting_branch(fused):
  inner = optax.sgd(0.5, momentum=0.9)  # scale-sensitive, unlike adam.
  tx = oa.accumulate(inner, every_k=K, axis_name="data")

  def step(params, state, batch):
    grads = jax.grad(mean_loss)(params, batch)  # local under pmap.
    if fused:  # applied in the emitting branch.
      return oa.update_and_apply(tx, grads, state, params,
                                 num_tokens=num_tokens(batch))
    updates, state = tx.update(
        grads, state, params, num_tokens=num_tokens(batch)
    )
    return optax.apply_updates(params, updates), state

  replicate = lambda t: jax.tree.map(lambda x: jnp.stack([x] * N), t)
  params = replicate(_params())
  state = replicate(tx.init(_params()))
  pstep = jax.pmap(step, axis_name="data")
  batch = jax.tree.map(
      lambda x: x.reshape((N, K, -1) + x.shape[1:]), _data()
  )
  for _ in range(2):
    for i in range(K):
      params, state = pstep(params, state, jax.tree.map(
          lambda x, i=i: x[:, i], batch))
  helpers.assert_trees_close(
      jax.tree.map(lambda p: p[0], params), _reference_trajectory(inner, 2),
      rtol=1e-5, atol=1e-6,
  )
  counts = oa.count_collectives(pstep.lower(
      params, state, jax.tree.map(lambda x: x[:, 0], batch)).compile())
  assert counts.total == counts.in_branch == {"all-reduce": 1}


def test_multisteps_communicates_on_every_micro_step():
  """optax.MultiSteps for comparison: one all-reduce per call, k per update."""
  tx = optax.MultiSteps(optax.adam(0.1), every_k_schedule=K)

  def step(params, state, batch):
    grads = jax.grad(mean_loss)(params, batch)  # psummed by autodiff.
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  mesh = _mesh(AxisType.Auto)
  params = _params()
  state = tx.init(params)
  sharded = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()
  ))
  counts = oa.count_collectives(
      sharded.lower(params, state, _data()).compile()
  )
  assert counts.outside == {"all-reduce": 1}  # on every call.

  def local_step(params, state, batch):
    return step(oa.device_local(params, "data"), state, batch)

  with pytest.raises(TypeError, match="cond branches"):
    jax.jit(jax.shard_map(
        local_step, mesh=mesh, in_specs=(P(), P(), P("data")),
        out_specs=P(),
    )).lower(params, state, _data())


def test_accumulate_under_plain_jit_names_the_axis():
  tx = oa.accumulate(optax.sgd(0.1), every_k=1, axis_name="data")
  params = _params()
  with pytest.raises(ValueError, match=r"shard_map or jax\.pmap"):
    jax.jit(tx.update)(params, tx.init(params), params)


# state_partition_specs.


@pytest.mark.slow
def test_state_partition_specs_suit_a_shard_map_over_data_on_a_2d_mesh():
  """docs/distributed.md's pattern with w split over an Explicit "model" axis.

  The running sums' types name "model" too; a shard_map over "data" alone
  refuses in_specs that name it (issue 28), and leaves it to the types.
  """
  mesh = _mesh(AxisType.Explicit, (4, 2), ("data", "model"))
  tx = oa.accumulate(optax.sgd(0.1), every_k=K, axis_name="data")

  def micro_step(params, acc_state, mb):
    grads = jax.grad(mean_loss)(oa.device_local(params, "data"), mb)
    updates, acc_state = tx.update(grads, acc_state, params,
                                   num_tokens=num_tokens(mb))
    return optax.apply_updates(params, updates), acc_state

  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), {"w": P("model"), "b": P()})
    acc_state = tx.init(params)
    specs = oa.state_partition_specs(acc_state, "data")
    assert specs.grad_sum == {"w": P("data"), "b": P("data")}
    step = jax.jit(jax.shard_map(
        micro_step, in_specs=(P(), specs, P("data")), out_specs=(P(), specs),
        axis_names={"data"}))
    for i in range(K):
      mb = jax.device_put(jax.tree.map(lambda x, i=i: x[i::K], _data()),
                          P("data"))
      params, acc_state = step(params, acc_state, mb)
  assert bool(oa.has_updated(acc_state))
  assert params["w"].sharding.spec == P("model")
  _, grads = _expected()
  helpers.assert_trees_close(
      params, jax.tree.map(lambda p, g: p - 0.1 * g, _params(), grads),
      rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_accumulate_on_a_2d_mesh_in_shard_map_with_sharded_params():
  """Manual over data and model: the inner state takes the params' specs."""
  mesh = _mesh(AxisType.Explicit, (4, 2), ("data", "model"))
  inner = optax.sgd(0.5, momentum=0.9)
  tx = oa.accumulate(inner, every_k=1, axis_name="data")

  def loss_fn(params, batch):  # w's rows are split over "model".
    index = jax.lax.axis_index("model")
    x = jax.lax.dynamic_slice_in_dim(
        batch["x"], index * (DIM // 2), DIM // 2, axis=-1)
    logits = jax.lax.psum(x @ params["w"], "model") + params["b"]
    losses = batch["mask"] * (jnp.tanh(logits) - batch["y"]) ** 2
    return losses.sum() / jnp.maximum(batch["mask"].sum(), 1.0)

  def step(params, state, batch):
    grads = jax.grad(loss_fn)(oa.device_local(params, "data"), batch)
    updates, state = tx.update(
        grads, state, params, num_tokens=num_tokens(batch))
    return optax.apply_updates(params, updates), state

  param_specs = {"w": P("model"), "b": P()}
  with jax.set_mesh(mesh):
    params = jax.device_put(_params(), param_specs)
    state = jax.shard_map(
        tx.init, in_specs=(param_specs,), out_specs=oa.state_partition_specs(
            jax.eval_shape(tx.init, _params()), "data", param_specs),
    )(params)
    specs = oa.state_partition_specs(state, "data", param_specs)
    assert specs.inner_state[0].trace == param_specs  # momentum.
    params, state = jax.jit(jax.shard_map(
        step, in_specs=(param_specs, specs, P("data")),
        out_specs=(param_specs, specs),
    ))(params, state, jax.device_put(_data(), P("data")))
  helpers.assert_trees_close(
      params, _reference_trajectory(inner, 1), rtol=1e-5, atol=1e-6
  )


# The 2-D mesh example.


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
@pytest.mark.slow
def test_mesh_2d_example_matches_the_single_device_full_batch(
    axis_types, capsys):
  mesh_2d = helpers.import_example("mesh_2d/main")
  results = mesh_2d.main(
      ["--k", "2", "--steps", "2", "--axis-types", axis_types]
  )
  np.testing.assert_allclose(
      results["losses"], results["reference_losses"], rtol=1e-5
  )
  assert results["grad_max_abs_diff"] < 1e-5
  assert results["param_max_abs_diff"] < 1e-5
  assert results["grad_specs"] == mesh_2d.train.model.PARAM_SPECS
  # In the loop only what the model needs on its own; over "data" only after.
  counts = results["collectives"]
  assert counts.in_loop == results["model_only_collectives"].in_loop
  assert counts.outside == {"all-reduce": 1}  # nothing gathered either.
  assert sum(results["naive_collectives"].in_loop.values()) > sum(
      counts.in_loop.values()
  )
  # The same, by mesh axis: the one collective in the loop is over "model"
  # (the model's own); over "data", one all-reduce after the loop.
  by_axes = results["collectives_by_axis"]
  assert set(by_axes) == {("data",), ("model",)}, by_axes
  assert by_axes[("data",)].in_loop == {}
  assert by_axes[("data",)].outside == {"all-reduce": 1}
  assert by_axes[("model",)].in_loop == (
      results["model_only_collectives"].in_loop)
  assert results["naive_collectives_by_axis"][("data",)].in_loop
  printed = capsys.readouterr().out
  assert "optax_accum     data   none" in printed, printed


@pytest.mark.slow
def test_docs_distributed_snippets_run_and_print_what_they_say(capsys):
  """The ```python blocks of docs/distributed.md, in order, in one namespace."""
  namespace = helpers.run_markdown_snippets("docs/distributed.md", min_blocks=5)
  printed = capsys.readouterr().out.splitlines()
  assert printed[:7] == [
      "{} {'all-reduce': 1}",  # Explicit axes: the gradient-sized ones.
      "P('data',) {}",
      "(\"params['b']\",) 25%",
      "{} {'all-reduce': 1}",  # Auto axes.
      "True {'all-reduce': 1} {}",
      "{'all-reduce': 1} {}",
      "(4,) {'all-reduce': 1}",  # oa.check_train_step: the CI recipe.
  ]
  first_device = jax.tree.map(lambda x: x[0], namespace["p_state"])
  assert bool(oa.has_updated(first_device))
