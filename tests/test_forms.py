"""``forms``: which parallel form a call runs in, decided once."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from optax_accum._src import forms


def _mesh(shape, names, kind=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _detect(axis_name, batch, params=None):
  """The form of a call on ``batch`` (each leaf split on axis 0)."""
  leaf_axes = [0] * len(jax.tree.leaves(batch))
  return forms.detect(axis_name, params, batch, leaf_axes)


def test_no_axis_on_host_inputs_is_single_with_no_mesh_to_enter():
  assert _detect(None, np.ones(4)) == forms.Form(forms.SINGLE, None, None, [0])


def test_an_auto_mesh_axis_is_mesh_and_an_explicit_one_typed():
  with jax.set_mesh(_mesh((2, 4), ("data", "model"), AxisType.Auto)):
    assert _detect("data", np.ones(8)) == forms.Form(
        forms.AUTO, "data", None, [0])
  with jax.set_mesh(_mesh((2, 4), ("data", "model"))):
    assert _detect("data", np.ones(8)) == forms.Form(
        forms.TYPED, "data", None, [0])


def test_a_batch_sharded_over_explicit_axes_is_typed_without_axis_name():
  mesh = _mesh((2, 4), ("data", "model"))
  with jax.set_mesh(mesh):
    batch = jax.device_put(jnp.ones((8, 3)), P("data"))
    assert _detect(None, batch) == forms.Form(forms.TYPED, "data", None, [0])
    with pytest.raises(ValueError, match=(
        r"axis_name='model' does not name the mesh axes that the batch is"
        r" sharded over along its batch axis, \['data'\]")):
      _detect("model", batch)


def test_size_one_axes_are_dropped_from_the_data_axes():
  with jax.set_mesh(_mesh((1, 8), ("data", "fsdp"), AxisType.Auto)):
    assert _detect("data", np.ones(8)).kind == forms.SINGLE
    assert _detect(("data", "fsdp"), np.ones(8)).axis_name == "fsdp"


def test_explicit_inputs_without_set_mesh_bring_their_mesh():
  mesh = _mesh((8,), ("data",))
  x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
  form = _detect("data", {"x": x})
  assert form.kind == forms.TYPED and form.enter == mesh.abstract_mesh
  assert _detect(None, x).enter == mesh.abstract_mesh


def test_inputs_on_two_meshes_are_refused():
  a = jax.device_put(jnp.ones(8), NamedSharding(_mesh((8,), ("data",)),
                                                P("data")))
  b = jax.device_put(jnp.ones(8), NamedSharding(_mesh((8,), ("other",)),
                                                P("other")))
  with pytest.raises(ValueError, match="two different meshes"):
    _detect(None, a, params=b)


def test_an_axis_that_is_nowhere_is_named():
  with pytest.raises(ValueError, match=r"axis_name='data'.*jax\.set_mesh"):
    _detect("data", np.ones(8))
  with jax.set_mesh(_mesh((8,), ("x",))):
    with pytest.raises(ValueError, match="no axis 'data'"):
      _detect("data", np.ones(8))


def test_a_manual_axis_is_manual():
  mesh = _mesh((8,), ("data",), AxisType.Auto)
  seen = []

  def body(x):
    seen.append(_detect("data", x))
    return x

  jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      jnp.ones(8))
  assert seen == [forms.Form(forms.MANUAL, "data", None, [0])]
