"""SPEC 13: the last micro-batch after the loop gives the loop's results.

With ``overlap_reduction=True`` ``oa.value_and_grad`` runs its last
micro-batch after the loop, so that XLA may overlap the one reduction with
that backward pass (GPUs; TPUs with the flags of ``docs/performance.md``).
The results are checked against the full batch's, as the loop's are:
uneven tokens, an empty micro-batch, every micro-batch empty, a traced
count of real micro-batches, aux and model state, in the typed and the
``shard_map`` forms; and it stays in the loop where a leaf is reduced in
each micro-batch. The compiled programs it makes on
TPU and GPU are read in ``tests/compiled/test_overlap_compiled.py``.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src import names
from optax_accum._src.microbatch import trip_count

K = 4
N = 8  # simulated devices (tests/conftest.py).
ROWS, SEQ, DIM = 2 * K * N, 3, 4
_value_and_grad = functools.partial(oa.value_and_grad, num_microbatches=K,
                                    overlap_reduction=True)


@pytest.fixture(autouse=True)
def last_after_the_loop(monkeypatch):
  """Whether each call ran its last micro-batch after the loop; each test's
  did, unless it says otherwise."""
  taken = []
  peeled = trip_count.peeled

  def spy(*args):
    taken.append(peeled(*args))
    return taken[-1]

  monkeypatch.setattr(trip_count, "peeled", spy)
  yield taken
  assert any(taken), "the last micro-batch did not leave the loop"


def _batch(seed, empty=()):
  """Uneven token counts; the micro-batches in ``empty`` (of each device's
  rows) without any."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, SEQ + 1, size=ROWS)
  rows = np.arange(ROWS).reshape(N, K, -1)
  for i in empty:
    lengths[rows[:, i].ravel()] = 0
  return helpers.padded_batch(rng, lengths, SEQ, DIM)


def _loss(params, batch):
  return helpers.safe_mean(helpers.mlp_token_losses(params, batch), batch)


def _full_batch(params, batch):
  return jax.jit(jax.value_and_grad(_loss))(params, batch)


def _mesh():
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def _typed(fn, params, batch, *args):
  with jax.set_mesh(_mesh()):
    return jax.jit(fn)(jax.device_put(params, P()),
                       jax.device_put(batch, P("data")), *args)


def _shard_map(fn, params, batch):
  mesh = _mesh()
  step = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                       out_specs=(P(), P()))
  return jax.jit(step)(
      jax.device_put(params, jax.NamedSharding(mesh, P())),
      jax.device_put(batch, jax.NamedSharding(mesh, P("data"))))


@pytest.mark.parametrize("empty", [(), (1,), (K - 1,)])
@pytest.mark.parametrize("form", ["typed", "shard_map"])
@pytest.mark.slow
def test_matches_the_full_batch(form, empty):
  params = helpers.mlp_params(DIM, 8, seed=0)
  batch = _batch(1, empty)
  if form == "typed":
    got = _typed(_value_and_grad(_loss,
                                   num_tokens_fn=helpers.num_tokens),
                 params, batch)
  else:
    got = _shard_map(_value_and_grad(
        _loss, num_tokens_fn=helpers.num_tokens,
        axis_name="data"), params, batch)
  helpers.assert_trees_close(got, _full_batch(params, batch), rtol=2e-5,
                             atol=1e-7)


@pytest.mark.parametrize("form", ["typed", "shard_map"])
def test_no_tokens_at_all_gives_zeros_not_nan(form):
  """The last micro-batch runs even where none has tokens (its sums NaN
  with a mean loss that divides by zero): the count of zero reads them as
  zeros, the token-weighted aux's too."""
  params = helpers.mlp_params(DIM, 8, seed=0)
  batch = _batch(2, empty=range(K))

  def loss_fn(p, b):
    value = helpers.raw_mean(helpers.mlp_token_losses(p, b), b)
    return value, {"mean": value}

  kwargs = dict(num_tokens_fn=helpers.num_tokens, has_aux=True,
                aux_reduction="mean")
  if form == "typed":
    (loss, aux), grads = _typed(_value_and_grad(loss_fn, **kwargs), params,
                                batch)
  else:
    (loss, aux), grads = _shard_map(_value_and_grad(
        loss_fn, axis_name="data", **kwargs), params, batch)
  assert float(loss) == 0.0
  assert float(aux["mean"]) == 0.0
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, np.zeros_like(g))


@pytest.mark.parametrize("num_real", [1, 3])
@pytest.mark.slow
def test_a_traced_count_of_real_micro_batches(num_real):
  """The ``num_real``-th runs after the loop; the others are not computed."""
  params = helpers.mlp_params(DIM, 8, seed=0)
  batch = _batch(3)
  fn = _value_and_grad(_loss,
                         num_tokens_fn=helpers.num_tokens)
  got = _typed(lambda p, b, n: fn(p, b, num_real_microbatches=n), params,
               batch, jnp.int32(num_real))
  # The first num_real of each device's K blocks of rows.
  rows = np.arange(ROWS).reshape(N, K, -1)[:, :num_real].ravel()
  real = jax.tree.map(lambda x: x[rows], batch)
  helpers.assert_trees_close(got, _full_batch(params, real), rtol=2e-5,
                             atol=1e-7)


def test_stacked_aux_and_model_state_come_out_in_order():
  """Each micro-batch's aux in its place (the last one's appended after
  the loop), and the model state threaded through all k."""
  params = helpers.mlp_params(DIM, 8, seed=0)
  batch = _batch(4)

  def loss(params, count, batch):
    value = _loss(params, batch)
    return value, (count + 1, helpers.num_tokens(batch))

  fn = _value_and_grad(loss, has_state=True,
                         has_aux=True, num_tokens_fn=helpers.num_tokens)
  with jax.set_mesh(_mesh()):
    (value, (count, aux)), grads = jax.jit(fn)(
        jax.device_put(params, P()), jnp.int32(0),
        jax.device_put(batch, P("data")))
  assert int(count) == K
  rows = np.arange(ROWS).reshape(N, K, -1)
  tokens = [float(helpers.num_tokens(jax.tree.map(
      lambda x, i=i: x[rows[:, i].ravel()], batch))) for i in range(K)]
  np.testing.assert_allclose(np.asarray(aux).ravel(), tokens)
  helpers.assert_trees_close((value, grads), _full_batch(params, batch),
                             rtol=2e-5, atol=1e-7)


def test_not_where_a_leaf_is_reduced_in_the_loop(last_after_the_loop):
  """A leaf reduced in each micro-batch (here every one, with
  gradient_sync="every_microbatch" on sharded parameters) keeps the last
  micro-batch in the loop: XLA moves such a loop's reductions after it as
  one, and the last micro-batch's own would be a second."""
  params = helpers.mlp_params(DIM, N, seed=0)
  batch = _batch(5)
  fn = _value_and_grad(_loss, axis_name="data",
                         num_tokens_fn=helpers.num_tokens,
                         gradient_sync="every_microbatch",
                         param_specs={"w1": P(None, "data"), "b1": P("data"),
                                      "w2": P("data")})
  mesh = _mesh()
  specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data")}
  step = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("data")),
                       out_specs=(P(), specs))
  got = jax.jit(step)(
      jax.device_put(params, {k: jax.NamedSharding(mesh, s)
                              for k, s in specs.items()}),
      jax.device_put(batch, jax.NamedSharding(mesh, P("data"))))
  helpers.assert_trees_close(got, _full_batch(params, batch), rtol=2e-5,
                             atol=1e-6)
  assert last_after_the_loop and not any(last_after_the_loop)
  last_after_the_loop.append(True)  # the fixture's check: done here.


def test_overlap_reduction_must_be_a_bool(last_after_the_loop):
  with pytest.raises(TypeError, match="overlap_reduction must be a bool, got"
                     " 'gpu' of type str"):
    oa.value_and_grad(_loss, num_microbatches=K, overlap_reduction="gpu")
  last_after_the_loop.append(True)  # nothing traced: the fixture's check.


@pytest.mark.parametrize("asked", [False, True])
def test_off_by_default_the_loop_stays_whole(asked, last_after_the_loop):
  """The compiled program holds the last micro-batch's named scope only
  where asked."""
  params = helpers.mlp_params(DIM, 8, seed=0)
  fn = oa.value_and_grad(_loss, num_microbatches=K, overlap_reduction=asked,
                         num_tokens_fn=helpers.num_tokens)
  with jax.set_mesh(_mesh()):
    text = jax.jit(fn).lower(jax.device_put(params, P()), jax.device_put(
        _batch(6), P("data"))).compile().as_text()
  assert (names.PEELED_SCOPE in text) == asked
  assert any(last_after_the_loop) == asked
  last_after_the_loop.append(True)
