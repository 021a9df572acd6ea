"""oa.check_replicas: copies compared by the part of the array they hold."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optax_accum as oa


def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)


def _replicated_with(values, sharding):
  """An array replicated by ``sharding`` whose device ``i`` holds
  ``values[i]``: copies that drifted apart."""
  devices = list(sharding.mesh.devices.flat)
  return jax.make_array_from_single_device_arrays(
      values[0].shape, sharding,
      [jax.device_put(v, d) for v, d in zip(values, devices)])


def test_equal_copies_pass_and_sharded_parts_are_not_copies():
  mesh = _mesh()
  tree = {
      "replicated": jax.device_put(jnp.arange(6.0), NamedSharding(mesh, P())),
      # Rows over "data" differ by design; each is copied over "model".
      "sharded": jax.device_put(jnp.arange(8.0).reshape(4, 2),
                                NamedSharding(mesh, P("data"))),
      "host": np.ones(3),
  }
  report = oa.check_replicas(tree)
  assert report.ok and report.worst is None
  assert report.checked == 2
  assert "ok" in str(report)


def test_copies_that_drifted_apart_are_named_with_the_difference():
  mesh = _mesh()
  sharding = NamedSharding(mesh, P())
  values = [np.full(3, 1.0, np.float32) for _ in range(8)]
  values[5] = values[5] + np.float32(0.25)
  tree = {"a": jax.device_put(jnp.ones(2), sharding),
          "b": {"w": _replicated_with(values, sharding)}}
  report = oa.check_replicas(tree)
  assert not report.ok
  assert report.worst == ("['b']['w']", 0.25)
  assert report.differing == (("['b']['w']", 0.25),)
  assert "['b']['w']: 0.25" in str(report)


def test_nan_equals_nan_but_not_a_number():
  sharding = NamedSharding(_mesh(), P())
  nan = np.full(2, np.nan, np.float32)
  assert oa.check_replicas(_replicated_with([nan] * 8, sharding)).ok
  report = oa.check_replicas(
      _replicated_with([nan] * 7 + [np.zeros(2, np.float32)], sharding))
  assert report.worst[1] == np.inf


def test_a_pmap_state_compares_its_rows():
  d = jax.device_count()
  replicate = jax.pmap(lambda x: x, axis_name="batch")
  params = {"w": jnp.ones(3), "b": jnp.float32(2.0)}
  same = replicate(jax.tree.map(lambda x: jnp.stack([x] * d), params))
  assert oa.check_replicas(same).ok
  assert oa.check_replicas(same).checked == 2
  drifted = dict(same, w=replicate(jnp.arange(d * 3.0).reshape(d, 3)))
  report = oa.check_replicas(drifted)
  assert not report.ok and report.worst[0] == "['w']"


def test_per_device_running_sums_of_accumulate_are_skipped():
  # With axis_name the running sums hold each device's partial value.
  d = jax.device_count()
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, axis_name="batch")
  params = {"w": jnp.ones(3)}

  def micro_step(opt_state, x):
    grads = {"w": x * jnp.ones(3)}
    _, opt_state = tx.update(grads, opt_state, params, num_tokens=1.0)
    return opt_state

  state = jax.tree.map(lambda x: jnp.stack([x] * d), tx.init(params))
  state = jax.pmap(micro_step, axis_name="batch")(state, jnp.arange(d * 1.0))
  report = oa.check_replicas(state)
  assert report.ok, report  # mid-window: partial sums differ by design.
  assert report.checked > 0


def test_an_unreduced_running_sum_is_skipped():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  grad_fn = oa.value_and_grad(
      lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), num_microbatches=1,
      gradient_sync="deferred", equal_weights=True)
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, equal_weights=True)
  with jax.set_mesh(mesh):
    params = {"w": jnp.ones(3)}
    batch = {"x": jax.device_put(jnp.arange(48.0).reshape(16, 3), P("data"))}
    _, grads = jax.jit(grad_fn)(params, batch)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    report = oa.check_replicas({"params": params, "state": state})
  assert report.ok, report


def test_equal_infinities_are_equal_and_a_complex_part_counts():
  """Copies holding the same -inf (a mask) agree; copies differing only in
  their imaginary part do not."""
  sharding = NamedSharding(_mesh(), P())
  mask = np.array([0.0, -np.inf, 1.0], np.float32)
  assert oa.check_replicas(_replicated_with([mask] * 8, sharding)).ok
  z = np.array([1 + 1j], np.complex64)
  report = oa.check_replicas(_replicated_with([z] * 7 + [z + 2j], sharding))
  assert not report.ok and report.worst[1] == 2.0


def test_a_leaf_sharded_over_the_set_one_axis_mesh_is_not_pmap_rows():
  """Under ``jax.set_mesh``, one row per device over that mesh's axis is a
  sharded array (FSDP), not a pmap's copies: no replicas to compare."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  w = jax.device_put(jnp.arange(16.0).reshape(8, 2),
                     NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    report = oa.check_replicas({"w": w})
  assert report.ok and report.checked == 0
  assert not oa.check_replicas({"w": w}).ok  # without it: read as rows.
