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


def test_no_axis_on_host_inputs_is_single_with_no_mesh_to_enter():
  assert forms.detect(None, np.ones(4)) == forms.Form(forms.SINGLE, None, None)


def test_a_set_mesh_axis_is_mesh():
  with jax.set_mesh(_mesh((2, 4), ("data", "model"))):
    form = forms.detect("data", np.ones(8))
  assert form == forms.Form(forms.MESH, "data", None)


def test_size_one_axes_are_dropped_from_the_data_axes():
  with jax.set_mesh(_mesh((1, 8), ("data", "fsdp"), AxisType.Auto)):
    assert forms.detect("data", np.ones(8)).kind == forms.SINGLE
    assert forms.detect(("data", "fsdp"), np.ones(8)).axis_name == "fsdp"


def test_explicit_inputs_without_set_mesh_bring_their_mesh():
  mesh = _mesh((8,), ("data",))
  x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
  form = forms.detect("data", {"x": x})
  assert form.kind == forms.MESH and form.enter == mesh.abstract_mesh
  assert forms.detect(None, x).enter == mesh.abstract_mesh


def test_inputs_on_two_meshes_are_refused():
  a = jax.device_put(jnp.ones(8), NamedSharding(_mesh((8,), ("data",)),
                                                P("data")))
  b = jax.device_put(jnp.ones(8), NamedSharding(_mesh((8,), ("other",)),
                                                P("other")))
  with pytest.raises(ValueError, match="two different meshes"):
    forms.detect(None, a, b)


def test_an_axis_that_is_nowhere_is_named():
  with pytest.raises(ValueError, match=r"axis_name='data'.*jax\.set_mesh"):
    forms.detect("data", np.ones(8))
  with jax.set_mesh(_mesh((8,), ("x",))):
    with pytest.raises(ValueError, match="no axis 'data'"):
      forms.detect("data", np.ones(8))


def test_a_manual_axis_is_manual():
  mesh = _mesh((8,), ("data",), AxisType.Auto)
  seen = []

  def body(x):
    seen.append(forms.detect("data", x))
    return x

  jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      jnp.ones(8))
  assert seen == [forms.Form(forms.MANUAL, "data", None)]
