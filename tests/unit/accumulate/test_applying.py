"""Tests of applying.py: oa.apply_if_updated and oa.update_and_apply."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

# nnx.pure became nnx.as_pure in newer flax; the oldest flax we support has
# only the former.
_pure = getattr(nnx, "as_pure", None) or nnx.pure


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2),
          "b": jnp.ones(2, jnp.bfloat16)}


def _grads(seed):
  keys = jax.random.split(jax.random.key(seed))
  return {"w": jax.random.normal(keys[0], (3, 2)),
          "b": jax.random.normal(keys[1], (2,), jnp.bfloat16)}


def _train_step(tx, apply):
  @jax.jit
  def step(params, state, grads, tokens):
    updates, state = tx.update(grads, state, params, num_tokens=tokens)
    return apply(params, updates, state), state
  return step


def _apply_always(params, updates, state):
  del state
  return optax.apply_updates(params, updates)


def test_same_trajectory_as_apply_updates_and_untouched_between_emits():
  # The optimizer state lives inside a chain: the lookup finds it.
  tx = optax.chain(optax.scale(2.0),
                   oa.accumulate(optax.adam(0.1), every_k=3))
  ours, theirs = (_train_step(tx, apply)
                  for apply in (oa.apply_if_updated, _apply_always))
  params = theirs_params = _params()
  state = theirs_state = tx.init(params)
  for i in range(7):
    before = params
    params, state = ours(params, state, _grads(i), 1.0 + i)
    theirs_params, theirs_state = theirs(theirs_params, theirs_state,
                                         _grads(i), 1.0 + i)
    helpers.assert_trees_equal(params, theirs_params)
    if not oa.has_updated(state):
      helpers.assert_trees_equal(params, before)
    else:
      assert not helpers.trees_close(params, before)
  assert int(oa.find_accumulate_state(state).count) == 2
  dtype = lambda x: x.dtype
  assert jax.tree.map(dtype, params) == jax.tree.map(dtype, _params())


def _top_level_primitives(fn, *args):
  return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


def test_the_add_is_inside_the_conditional():
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  params = {"w": jnp.ones(3)}
  updates, state = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
  ours = _top_level_primitives(oa.apply_if_updated, params, updates, state)
  # The negative control: apply_updates adds on every call.
  plain = _top_level_primitives(_apply_always, params, updates, state)
  assert "add" in plain and "cond" not in plain
  assert "add" not in ours and "cond" in ours


def test_refuses_a_state_without_ours():
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"^state must contain an Accumulate"):
    oa.apply_if_updated(params, params, optax.sgd(1.0).init(params))
  with pytest.raises(ValueError, match=r"^state must contain.*NoneType"):
    oa.apply_if_updated(params, params, None)


def test_refuses_updates_not_shaped_like_the_params():
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  params = {"w": jnp.ones(2), "b": jnp.ones(())}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"^updates must have the tree"):
    oa.apply_if_updated(params, {"w": jnp.ones(2)}, state)
  with pytest.raises(ValueError, match=r"updates\['w'\] has shape \(3,\)"):
    oa.apply_if_updated(params, {"w": jnp.ones(3), "b": jnp.ones(())}, state)


@pytest.mark.slow
def test_nnx_without_optimizer_update_matches_nnx_optimizer():
  # nnx.Optimizer.update adds the (zero) updates itself: the documented
  # alternative calls the transformation and writes the parameters back.
  def make():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    tx = oa.accumulate(optax.adamw(0.1), every_k=2)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(model, x):
    return (model(x) ** 2).mean()

  @nnx.jit
  def reference_step(model, optimizer, x):
    grads = nnx.grad(loss_fn)(model, x)
    optimizer.update(model, grads, num_tokens=x.shape[0])

  @nnx.jit
  def our_step(model, optimizer, x):
    grads = nnx.grad(loss_fn)(model, x)
    params = _pure(nnx.state(model, nnx.Param))
    opt_state = _pure(optimizer.opt_state)
    updates, opt_state = optimizer.tx.update(
        _pure(grads), opt_state, params,
        num_tokens=x.shape[0])
    nnx.update(model, oa.apply_if_updated(params, updates, opt_state))
    nnx.update(optimizer.opt_state, nnx.state(opt_state))

  (ref_model, ref_opt), (model, opt) = make(), make()
  rng = np.random.default_rng(0)
  for rows in (1, 4, 2, 3, 5):
    x = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
    reference_step(ref_model, ref_opt, x)
    our_step(model, opt, x)
    helpers.assert_trees_close(nnx.state(model, nnx.Param),
                               nnx.state(ref_model, nnx.Param), rtol=1e-5,
                               atol=1e-6)
  assert int(oa.find_accumulate_state(opt.opt_state).count) == 2


def _fused_train_step(tx):
  @jax.jit
  def step(params, state, grads, tokens, emit=None):
    return oa.update_and_apply(tx, grads, state, params, num_tokens=tokens,
                               emit=emit)
  return step


@pytest.mark.parametrize("inner", [
    "adam", pytest.param("muon", marks=pytest.mark.slow), "chain"])
def test_update_and_apply_matches_update_then_apply_if_updated(inner):
  """Applied in the emitting branch (or, around a chain, after it): the
  same parameters and state as tx.update + oa.apply_if_updated, through a
  cycle with no tokens and an early flush (emit=True)."""
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3),
            "b": jnp.ones(3, jnp.bfloat16)}
  if inner == "chain":
    tx = optax.chain(optax.scale(2.0),
                     oa.accumulate(optax.adam(0.1), every_k=3))
  else:
    opt = (optax.adam(0.1) if inner == "adam" else optax.contrib.muon(0.1))
    tx = oa.accumulate(opt, every_k=3)
  fused = _fused_train_step(tx)
  split = jax.jit(lambda p, s, g, n, emit=None: (lambda u, s: (
      oa.apply_if_updated(p, u, s), s))(*tx.update(g, s, p, num_tokens=n,
                                                   emit=emit)))
  ours = theirs = (params, tx.init(params))
  tokens = [2.0, 5.0, 1.0, 0.0, 0.0, 0.0, 3.0, 4.0]  # cycle 2: no tokens.
  for i, n in enumerate(tokens):
    emit = True if i == len(tokens) - 1 else None  # an early flush.
    grads = {"w": jax.random.normal(jax.random.key(i), (4, 3)),
             "b": jnp.full(3, 0.5 * i, jnp.bfloat16)}
    ours = fused(*ours, grads, n, emit)
    theirs = split(*theirs, grads, n, emit)
    # XLA fuses the add with the update there: a last-bit difference.
    helpers.assert_trees_close(helpers.settled(ours), helpers.settled(theirs),
                               rtol=1e-6, atol=1e-8)
  assert int(oa.find_accumulate_state(ours[1]).count) == 2
  assert not helpers.trees_close(ours[0], params)
  dtype = lambda x: x.dtype
  assert jax.tree.map(dtype, ours[0]) == jax.tree.map(dtype, params)


@pytest.mark.parametrize("emits", [True, False])
def test_update_and_apply_differentiates_as_the_split_path(emits):
  """Reverse mode through an update (meta-learning: the derivative of the
  new parameters in a learning rate and the gradients), which a loop of
  dynamic trip count alone would refuse; the same as through tx.update +
  oa.apply_if_updated, whether the call emits or not."""
  params = {"w": jnp.linspace(-1.0, 1.0, 6)}

  def new_params(lr, scale, fused):
    tx = oa.accumulate(optax.sgd(lr, momentum=0.9), every_k=1 if emits else 2,
                       equal_weights=True)
    state = tx.init(params)
    grads = {"w": scale * jnp.cos(params["w"])}
    if fused:
      return oa.update_and_apply(tx, grads, state, params)[0]
    updates, state = tx.update(grads, state, params)
    return oa.apply_if_updated(params, updates, state)

  def loss(lr, scale, fused):
    return jnp.sum(new_params(lr, scale, fused)["w"] ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  ours, theirs = grad(0.1, 2.0, True), grad(0.1, 2.0, False)
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  assert (float(theirs[0]) != 0.0) == emits, theirs


def test_update_and_apply_needs_the_params():
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match="needs the parameters: params=None"):
    oa.update_and_apply(tx, params, tx.init(params), None)


def _two_calls(tx, params):
  """The state before and after a non-emitting call, then an emitting one."""
  state = tx.init(params)
  _, state = tx.update(_grads(0), state, params)
  return state


@pytest.mark.parametrize("jit", [True, False])
def test_apply_if_updated_refuses_swapped_params_and_updates(jit):
  tx = oa.accumulate(optax.adam(0.1), every_k=2, equal_weights=True)
  params = _params()

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return oa.apply_if_updated(updates, params, state)

  step = jax.jit(step) if jit else step
  with pytest.raises(ValueError,
                     match="the parameters and the updates are swapped"):
    step(params, tx.init(params), _grads(1))


def test_a_calls_state_applies_after_it_went_into_the_next_update():
  """Update, update again, then apply the first call's updates with that
  call's own state: a correct program, which a mark on the state given to
  tx.update used to refuse."""
  tx = optax.chain(optax.scale(2.0),
                   oa.accumulate(optax.sgd(0.1), every_k=1,
                                 equal_weights=True))
  params = _params()
  updates, state = tx.update(_grads(0), tx.init(params), params)
  tx.update(_grads(1), state, params)  # the state goes into the next call.
  applied = oa.apply_if_updated(params, updates, state)
  helpers.assert_trees_equal(applied, optax.apply_updates(params, updates))


def _signature_error(*args, **kwargs):
  with pytest.raises(TypeError) as info:
    oa.update_and_apply(*args, **kwargs)
  message = str(info.value)
  assert "oa.update_and_apply(tx, grads, state, params" in message, message
  return message


def test_update_and_apply_names_itself_for_a_missing_or_misplaced_tx():
  tx = oa.accumulate(optax.sgd(1.0), every_k=2, equal_weights=True)
  params = _params()
  state = tx.init(params)
  assert "missing params" in _signature_error(_grads(0), state, params)
  assert "another order" in _signature_error(_grads(0), tx, state, params)
  assert "another order" in _signature_error(tx, state, _grads(0), params)
  assert "another order" in _signature_error(tx, _grads(0), params, state)
  assert "missing grads, state, params" in _signature_error(tx)


@pytest.mark.parametrize("call", ["update", "update_and_apply"])
def test_a_params_tree_unlike_the_state_is_named_by_its_path(call):
  tx = oa.accumulate(optax.adam(0.1), every_k=2, equal_weights=True)
  params = _params()
  state = tx.init(params)
  missing = {"w": params["w"]}
  reshaped = {"w": params["w"].reshape(2, 3), "b": params["b"]}
  run = ((lambda p: tx.update(_grads(0), state, p)) if call == "update"
         else (lambda p: oa.update_and_apply(tx, _grads(0), state, p)))
  with pytest.raises(ValueError, match=r"params.*\['b'\]"):
    run(missing)
  with pytest.raises(ValueError, match=r"params\['w'\] has shape \(2, 3\)"):
    run(reshaped)


def _inner_counting(inner, calls):
  def update(updates, state, params=None, **extra_args):
    calls.append(1)
    return inner.update(updates, state, params, **extra_args)
  return optax.GradientTransformationExtraArgs(inner.init, update)


@pytest.mark.parametrize("call", ["update", "update_and_apply", "chain"])
@pytest.mark.parametrize("inner", ["adamw", "muon"])
def test_inner_update_is_traced_once_per_call(call, inner):
  """Issue 49 item 3: optax.MultiSteps traces its inner twice; ours once,
  whatever variants lax.platform_dependent traces."""
  calls = []
  opt = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(optax.cosine_decay_schedule(0.1, 10))
                    if inner == "adamw" else optax.contrib.muon(0.1))
  tx = oa.accumulate(_inner_counting(opt, calls), every_k=4)
  if call == "chain":
    tx = optax.chain(optax.scale(1.0), tx)
  params = {"w": jnp.ones((4, 3)), "v": jnp.ones((3, 2))}
  state = tx.init(params)
  step = ((lambda g, s, p: oa.update_and_apply(tx, g, s, p, num_tokens=2))
          if call == "update_and_apply"
          else (lambda g, s, p: tx.update(g, s, p, num_tokens=2)))
  jax.jit(step).trace(params, state, params)
  assert len(calls) == 1
  calls.clear()
  multi_steps = optax.MultiSteps(_inner_counting(opt, calls), 4)
  jax.jit(multi_steps.update).trace(params, multi_steps.init(params), params)
  assert len(calls) == 2  # the peer's count, for the record.


@pytest.mark.parametrize("inner", [
    "adamw", pytest.param("muon", marks=pytest.mark.slow)])
def test_update_and_apply_is_one_fused_inner_step_bit_for_bit(inner):
  """With every_k=1 the mean is the gradient: with adamw,
  update_and_apply's parameters are those of one jitted inner.update +
  optax.apply_updates, bit for bit (XLA fuses the add alike); against
  tx.update then optax.apply_updates, whose updates are rounded before the
  add, the last bits may differ: the docstring's bound (3 float32 ulp
  measured over 10 updates, adamw and Muon), held here with one to spare."""
  opt = optax.adamw(0.01) if inner == "adamw" else optax.contrib.muon(0.01)
  params = {"w": jax.random.normal(jax.random.key(0), (16, 8)),
            "v": jax.random.normal(jax.random.key(1), (8, 4))}
  tx = oa.accumulate(opt, every_k=1, equal_weights=True)
  fused = jax.jit(lambda g, s, p: oa.update_and_apply(tx, g, s, p))
  split = jax.jit(lambda g, s, p: (lambda u, s: (
      optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
  plain = jax.jit(lambda g, s, p: (lambda u, s: (
      optax.apply_updates(p, u), s))(*opt.update(g, s, p)))
  ours = theirs = (params, tx.init(params))
  reference = (params, opt.init(params))
  for i in range(10):
    key = jax.random.key(10 + i)
    grads = jax.tree.map(lambda x, key=key: jax.random.normal(key, x.shape),
                         params)
    ours = fused(grads, ours[1], ours[0])
    theirs = split(grads, theirs[1], theirs[0])
    reference = plain(grads, reference[1], reference[0])
    if inner == "adamw":
      helpers.assert_trees_equal(ours[0], reference[0])
  jax.tree.map(lambda a, b: np.testing.assert_array_max_ulp(a, b, maxulp=4),
               ours[0], theirs[0])


def test_update_and_apply_names_a_missing_accumulate():
  # A plain optimizer has no cycle: our error says to wrap it.
  params = {"w": jnp.ones(3)}
  tx = optax.adamw(1e-3)
  with pytest.raises(TypeError, match=r"tx = oa.accumulate\(optimizer"):
    oa.update_and_apply(tx, params, tx.init(params), params)
