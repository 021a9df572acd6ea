"""``forms``: which parallel form a call runs in, decided once."""

import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import optax_accum as oa
from optax_accum._src.microbatch import forms


def _mesh(shape, names, kind=AxisType.Explicit):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _detect(axis_name, batch, params=None):
  """The form of a call on ``batch`` (each leaf split on axis 0)."""
  leaf_axes = [0] * len(jax.tree.leaves(batch))
  return forms.detect_form(axis_name, params, batch, leaf_axes)


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


# Auto axes, a batch sharded over them, no axis_name: a warning, once.


@pytest.fixture
def fresh_warnings(monkeypatch):
  """Forgets which meshes were warned about (the warning comes once)."""
  monkeypatch.setattr(forms, "_warned_auto", set(), raising=False)


def _step(axis_name=None):
  fn = oa.value_and_grad(lambda w, mb: jnp.mean((mb @ w) ** 2),
                         num_microbatches=2, equal_weights=True,
                         axis_name=axis_name)

  @jax.jit
  def step(w, batch):
    return fn(w, batch)  # the caller's line the warning names.

  return step


def _sharded_call(kind, axis_name=None):
  with jax.set_mesh(_mesh((8,), ("data",), kind)):
    batch = jax.device_put(jnp.ones((16, 3)), P("data"))
    return _step(axis_name)(jnp.ones(3), batch)


AUTO_WARNING = (r"If the batch is sharded over the Auto mesh axes \['data'\]"
                r" and axis_name is None.*every micro-batch.*"
                r"axis_name='data'.*Explicit")


def test_auto_axes_without_axis_name_warn_once_at_the_callers_line(
    fresh_warnings):
  """Failed before: nothing said that each micro-batch was all-reduced."""
  del fresh_warnings
  with pytest.warns(UserWarning, match=AUTO_WARNING) as caught:
    _sharded_call(AxisType.Auto)
  assert [w.filename for w in caught] == [__file__]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _sharded_call(AxisType.Auto)  # once per mesh.


@pytest.mark.slow
def test_a_concrete_batch_names_the_auto_axes_it_is_sharded_over(
    fresh_warnings):
  del fresh_warnings
  fn = oa.value_and_grad(lambda w, mb: jnp.mean((mb @ w) ** 2),
                         num_microbatches=2, equal_weights=True)
  with jax.set_mesh(_mesh((2, 4), ("data", "model"), AxisType.Auto)):
    batch = jax.device_put(jnp.ones((16, 3)), P("data"))
    with pytest.warns(UserWarning, match=r"The batch is sharded over the"
                      r" Auto mesh axes \['data'\].*axis_name='data'"):
      fn(jnp.ones(3), batch)
    forms._warned_auto.clear()  # pylint: disable=protected-access
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      fn(jnp.ones(3), jax.device_put(jnp.ones((16, 3)), P()))


@pytest.mark.parametrize("kind, axis_name", [
    (AxisType.Auto, "data"), (AxisType.Explicit, None),
    (AxisType.Explicit, "data")])
def test_no_auto_warning_with_axis_name_or_on_explicit_axes(
    fresh_warnings, kind, axis_name):
  del fresh_warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _sharded_call(kind, axis_name)


@pytest.mark.parametrize("axis_name, in_loop", [(None, 1), ("data", 0)])
def test_what_the_auto_warning_says_holds_on_cpu(fresh_warnings, axis_name,
                                                 in_loop):
  """Without axis_name the gradient's all-reduce sits in the loop (once per
  micro-batch); with it, once after the loop."""
  del fresh_warnings
  with jax.set_mesh(_mesh((8,), ("data",), AxisType.Auto)):
    batch = jax.device_put(jnp.ones((16, 3)), P("data"))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      compiled = _step(axis_name).lower(jnp.ones(3), batch).compile()
  counts = oa.count_collectives(compiled, include_scalars=False)
  assert counts.in_loop.get("all-reduce", 0) == in_loop, counts
