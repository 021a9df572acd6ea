"""oa.accumulate in real training loops: emit=, should_skip=, token budgets.

- An epoch that ends inside a cycle: ``emit=True`` on its last micro-batch
  gives the exact mean of the partial window, so training follows full-batch
  training on batches of 4, 4 and 2 micro-batches' worth of data (uneven
  masks, clipping, AdamW, a schedule), not Lightning's partial window scaled
  by k, nor mlx-lm's dropped one. ``emit=(i == last)``, a Python bool or a
  traced one, does the same: ``emit`` is OR-ed with ``every_k``, so a False
  never holds a cycle open.
- A boundary chosen by the data (``every_k=None``): emit when the tokens
  reach a budget, then flush what is left at the end with zero gradients and
  ``num_tokens=0``.
- ``should_skip`` drops exactly the micro-steps it flags, and combines with
  ``skip_nonfinite``.
- ``emit`` passed traced does not retrace, never reaches ``inner``, and under
  ``shard_map`` and ``pmap`` still costs one reduction per update.
"""

import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa
import trajectories as tr

K = 4
RTOL, ATOL = 1e-5, 1e-6  # float32, summed in another order.


def _grads(seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), 2)
  return {"w": scale * jax.random.normal(keys[0], (3, 2)),
          "b": scale * jax.random.normal(keys[1], (2,))}


def _mean(grads_and_tokens):
  """The exact token-weighted mean, negated (what sgd(1.0) emits)."""
  total = sum(n for _, n in grads_and_tokens)
  return jax.tree.map(
      lambda *gs: -sum(n * g for (_, n), g in zip(grads_and_tokens, gs))
      / total,
      *[g for g, _ in grads_and_tokens],
  )


def _zeros():
  return jax.tree.map(jnp.zeros_like, helpers.layer_params())


# --------------------------------------------------------------------------
# emit=


@pytest.mark.parametrize("traced", [False, True], ids=["python", "traced"])
def test_emit_true_ends_a_partial_window_with_its_exact_mean(traced):
  tx = oa.accumulate(optax.sgd(1.0), K)
  update = jax.jit(tx.update, static_argnames=None if traced else "emit")
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  feed = [(_grads(i), float(i + 1)) for i in range(6)]
  emits = [None, True, None, None, None, None]  # 2 micro-steps, then 4.
  outs = []
  for (grads, n), emit in zip(feed, emits):
    if traced:
      emit = jnp.bool_(bool(emit))  # False, traced, leaves it to every_k.
    updates, state = update(grads, state, params, num_tokens=n, emit=emit)
    outs.append((updates, state))
  assert [bool(oa.has_updated(s)) for _, s in outs] == [
      False, True, False, False, False, True]
  helpers.assert_trees_close(outs[1][0], _mean(feed[:2]), rtol=RTOL,
                             atol=ATOL)
  # The next cycle starts from a clean sum, and is a full one again.
  helpers.assert_trees_close(outs[5][0], _mean(feed[2:]), rtol=RTOL,
                             atol=ATOL)
  assert int(outs[5][1].count) == 2


@pytest.mark.parametrize("traced", [False, True], ids=["python", "traced"])
def test_emit_false_leaves_the_cycle_to_every_k(traced):
  tx = oa.accumulate(optax.sgd(1.0), 2)
  update = jax.jit(tx.update, static_argnames=None if traced else "emit")
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  feed = [(_grads(i), 2.0 + i) for i in range(4)]
  outs = []
  for (grads, n), emit in zip(feed, [False, False, None, False]):
    emit = jnp.bool_(emit) if traced and emit is not None else emit
    updates, state = update(grads, state, params, num_tokens=n, emit=emit)
    outs.append((updates, state))
  assert [bool(oa.has_updated(s)) for _, s in outs] == [
      False, True, False, True]
  helpers.assert_trees_close(outs[1][0], _mean(feed[:2]), rtol=RTOL,
                             atol=ATOL)
  helpers.assert_trees_close(outs[3][0], _mean(feed[2:]), rtol=RTOL,
                             atol=ATOL)


@pytest.mark.parametrize("traced", [False, True], ids=["python", "traced"])
def test_every_k_none_ends_cycles_only_on_emit(traced):
  tx = oa.accumulate(optax.sgd(1.0), None)
  update = jax.jit(tx.update, static_argnames=None if traced else "emit")
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  feed = [(_grads(i), 1.0 + i) for i in range(7)]
  emits = [None, False, None, None, True, False, True]  # after 5, then 2.
  outs = []
  for (grads, n), emit in zip(feed, emits):
    emit = jnp.bool_(emit) if traced and emit is not None else emit
    updates, state = update(grads, state, params, num_tokens=n, emit=emit)
    outs.append((updates, state))
  assert [bool(oa.has_updated(s)) for _, s in outs] == [
      bool(e) for e in emits]
  helpers.assert_trees_close(outs[4][0], _mean(feed[:5]), rtol=RTOL,
                             atol=ATOL)
  helpers.assert_trees_close(outs[6][0], _mean(feed[5:]), rtol=RTOL,
                             atol=ATOL)
  assert int(outs[3][1].micro_step) == 4 and int(state.count) == 2


def test_traced_emit_does_not_retrace():
  traces = []
  tx = oa.accumulate(optax.adamw(0.1), K)

  @jax.jit
  def step(params, state, grads, emit):
    traces.append(1)
    updates, state = tx.update(grads, state, params, num_tokens=2.0,
                               emit=emit)
    return optax.apply_updates(params, updates), state

  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  emitted = []
  for i, emit in enumerate([False, True, False, False, True, True]):
    params, state = step(params, state, _grads(i), jnp.bool_(emit))
    emitted.append(bool(oa.has_updated(state)))
  assert emitted == [False, True, False, False, True, True]
  assert len(traces) == 1


@pytest.mark.slow
def test_flush_ends_the_cycle_without_a_new_gradient():
  tx = oa.accumulate(optax.adam(0.1), K)
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  feed = [(_grads(i), float(i + 2)) for i in range(3)]
  for grads, n in feed:
    _, state = tx.update(grads, state, params, num_tokens=n)
  flush = jax.jit(functools.partial(tx.update, num_tokens=0, emit=True))
  updates, flushed = flush(_zeros(), state, params)
  expected, _ = optax.adam(0.1).update(
      jax.tree.map(jnp.negative, _mean(feed)), state.inner_state, params
  )
  helpers.assert_trees_close(updates, expected, rtol=RTOL, atol=ATOL)
  assert bool(oa.has_updated(flushed)) and int(flushed.count) == 1
  # Flushing again: a cycle with no tokens emits zeros, adam is untouched.
  updates, again = flush(_zeros(), flushed, params)
  helpers.assert_trees_equal(updates, _zeros())
  helpers.assert_trees_equal(again.inner_state, flushed.inner_state)
  assert not bool(oa.has_updated(again)) and int(again.count) == 1
  assert int(again.micro_step) == 0 and float(again.token_count) == 0.0


def test_emit_is_never_passed_to_inner():
  seen = []

  def update_fn(updates, state, params=None, **extra_args):
    seen.append(sorted(extra_args))
    return optax.sgd(1.0).update(updates, state, params)

  inner = optax.GradientTransformationExtraArgs(optax.sgd(1.0).init,
                                                update_fn)
  tx = oa.accumulate(inner, K)
  state = tx.init(helpers.layer_params())
  for emit in (True, jnp.bool_(False), None):
    _, state = tx.update(_grads(0), state, helpers.layer_params(),
                         num_tokens=1.0, emit=emit, value=1.0)
  assert seen and all(keys == ["value"] for keys in seen), seen


# --------------------------------------------------------------------------
# The end of an epoch: the partial window is a smaller full batch.

_EPOCH = tr.make_batches([4, 4, 2])


# How the last micro-batch of the epoch is flagged: True on it and None on
# the others; ``emit=(i == last)``, a Python bool; the same traced.
_EMIT_FORMS = {
    "true_or_none": lambda is_last: True if is_last else None,
    "python_bool": lambda is_last: is_last,
    "traced_bool": jnp.bool_,
}


def _epoch_trajectory(tx, emit_form="true_or_none"):
  """One epoch of 10 micro-batches, the last one flagged with ``emit``."""
  traced = emit_form == "traced_bool"

  @functools.partial(jax.jit, static_argnames=None if traced else "emit")
  def step(params, opt_state, micro_batch, emit=None):
    grads = jax.grad(tr.mean_loss)(params, micro_batch)
    updates, opt_state = tx.update(
        grads, opt_state, params, num_tokens=helpers.num_tokens(micro_batch),
        emit=emit,
    )
    return optax.apply_updates(params, updates), opt_state

  micro_batches = [mb for batch in _EPOCH
                   for mb in tr.micro_batches_of(batch)]
  assert len(micro_batches) == 10
  params = tr.initial_params()
  opt_state = tx.init(params)
  trajectory = []
  for i, mb in enumerate(micro_batches):
    is_last = i == len(micro_batches) - 1
    params, opt_state = step(params, opt_state, mb,
                             emit=_EMIT_FORMS[emit_form](is_last))
    if oa.has_updated(opt_state):
      trajectory.append(params)
  return trajectory, opt_state


@pytest.mark.parametrize("emit_form", [
    f if f == "traced_bool" else pytest.param(f, marks=pytest.mark.slow)
    for f in _EMIT_FORMS])
def test_epoch_end_partial_window_matches_full_batch_training(emit_form):
  tx = oa.accumulate(tr.inner_optimizer(), K)
  trajectory, state = _epoch_trajectory(tx, emit_form)
  assert len(trajectory) == 3  # every_k's two updates, then the partial.
  expected, grad_norms = tr.full_batch_trajectory(_EPOCH)
  tr.assert_same_trajectory(trajectory, expected)
  assert tr.inner_counts(state.inner_state) == [3, 3]
  assert any(n > tr.CLIP for n in grad_norms)  # clipping bites.
  # Negative controls: Lightning scaled the partial window by 2/4 (its sum
  # of micro-batch means divided by k); mlx-lm dropped it.
  lightning, _ = tr.full_batch_trajectory(
      _EPOCH, grad_scale=lambda b: 0.5 if len(b["mask"]) == 4 else 1.0
  )
  assert tr.differs(lightning, expected)
  assert tr.differs(expected[:2], expected)


# --------------------------------------------------------------------------
# A token budget: a boundary chosen by the data.

BUDGET = 24.0


def _budget_groups(micro_batches):
  """The micro-batches of each update: emit once the tokens reach BUDGET."""
  groups, group, tokens = [], [], 0.0
  for mb in micro_batches:
    group.append(mb)
    tokens += float(helpers.num_tokens(mb))
    if tokens >= BUDGET:
      groups.append(group)
      group, tokens = [], 0.0
  return groups, group


@pytest.mark.slow
def test_token_budget_boundary_matches_full_batch_training():
  stream = [mb for batch in tr.make_batches([12])
            for mb in tr.micro_batches_of(batch)]
  groups, rest = _budget_groups(stream)
  assert len({len(g) for g in groups}) > 1 and rest, "boundaries too regular"
  tx = oa.accumulate(tr.inner_optimizer(), every_k=None)

  @jax.jit
  def step(params, opt_state, micro_batch):
    grads = jax.grad(tr.mean_loss)(params, micro_batch)
    n = helpers.num_tokens(micro_batch)
    emit = opt_state.token_count + n >= BUDGET  # the state before the call.
    updates, opt_state = tx.update(grads, opt_state, params, num_tokens=n,
                                   emit=emit)
    return optax.apply_updates(params, updates), opt_state

  params = tr.initial_params()
  opt_state = tx.init(params)
  trajectory = []
  for mb in stream:
    params, opt_state = step(params, opt_state, mb)
    if oa.has_updated(opt_state):
      trajectory.append(params)
  # The end of the stream: flush what is left, with no new gradient.
  updates, opt_state = tx.update(jax.tree.map(jnp.zeros_like, params),
                                 opt_state, params, num_tokens=0, emit=True)
  trajectory.append(optax.apply_updates(params, updates))
  batches = [jax.tree.map(lambda *xs: jnp.concatenate(xs), *g)
             for g in groups + [rest]]
  expected, _ = tr.full_batch_trajectory(batches)
  tr.assert_same_trajectory(trajectory, expected)
  assert float(opt_state.token_count) == 0.0 and int(opt_state.count) == len(
      batches)


# --------------------------------------------------------------------------
# should_skip.

THRESHOLD = 10.0


def _norm_above_threshold(grads, state, params):
  del state, params
  return optax.tree.norm(grads) > THRESHOLD


@pytest.mark.slow
def test_should_skip_drops_exactly_the_flagged_micro_steps():
  spikes = {1, 4, 5}
  feed = [(_grads(i, 100.0 if i in spikes else 1.0), float(i + 1))
          for i in range(8)]
  tx = oa.accumulate(optax.sgd(1.0), K, should_skip=_norm_above_threshold)
  update = jax.jit(tx.update)
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  outs = []
  for grads, n in feed:
    updates, state = update(grads, state, params, num_tokens=n)
    outs.append((updates, state))
  flagged = [float(optax.tree.norm(g)) > THRESHOLD for g, _ in feed]
  assert [i for i, f in enumerate(flagged) if f] == sorted(spikes)
  for end in (3, 7):  # a full cycle of 4 micro-steps, skips included.
    kept = [feed[i] for i in range(end - 3, end + 1) if i not in spikes]
    helpers.assert_trees_close(outs[end][0], _mean(kept), rtol=RTOL,
                               atol=ATOL)
  assert [int(s.skipped_count) for _, s in outs] == list(
      np.cumsum(flagged))
  assert int(state.count) == 2 and int(state.nonfinite_count) == 0
  # Negative control: without should_skip the spikes dominate.
  plain = oa.accumulate(optax.sgd(1.0), K)
  plain_state = plain.init(params)
  for grads, n in feed[:4]:
    plain_updates, plain_state = plain.update(grads, plain_state, params,
                                              num_tokens=n)
  assert not helpers.trees_close(plain_updates, outs[3][0], rtol=1e-2)


def test_should_skip_sees_the_state_before_the_call():
  tx = oa.accumulate(optax.sgd(1.0), 3,
                     should_skip=lambda g, s, p: s.micro_step == 1)
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  feed = [(_grads(i), 1.0 + i) for i in range(3)]
  for grads, n in feed:
    updates, state = tx.update(grads, state, params, num_tokens=n)
  helpers.assert_trees_close(updates, _mean([feed[0], feed[2]]), rtol=RTOL,
                             atol=ATOL)
  assert int(state.skipped_count) == 1


def test_should_skip_and_skip_nonfinite_combine():
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _grads(1))
  feed = [(_grads(0), 2.0), (nan, 3.0), (_grads(2, 100.0), 4.0),
          (_grads(3), 5.0)]
  tx = oa.accumulate(optax.sgd(1.0), K, skip_nonfinite=True,
                     should_skip=_norm_above_threshold)
  update = jax.jit(tx.update)
  params, state = helpers.layer_params(), tx.init(helpers.layer_params())
  for grads, n in feed:
    updates, state = update(grads, state, params, num_tokens=n)
  helpers.assert_trees_close(updates, _mean([feed[0], feed[3]]), rtol=RTOL,
                             atol=ATOL)
  assert int(state.nonfinite_count) == 1 and int(state.skipped_count) == 1
  # A cycle where every micro-step is dropped is a zero-token cycle.
  for grads, n in [(nan, 1.0), (_grads(5, 100.0), 1.0)] * 2:
    updates, state = update(grads, state, params, num_tokens=n)
  helpers.assert_trees_equal(updates, _zeros())
  assert not bool(oa.has_updated(state)) and int(state.count) == 1
  assert int(state.nonfinite_count) == 3 and int(state.skipped_count) == 3


# --------------------------------------------------------------------------
# emit with axis_name: still one reduction per update.

N, SEQ, DIM = 8, 4, 8


def _distributed_data(num_micro_steps):
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(num_micro_steps):
    lengths = rng.integers(0, SEQ + 1, size=2 * N)
    batch = helpers.padded_batch(rng, lengths, SEQ, DIM)
    batches.append(jax.tree.map(jnp.asarray, batch))
  return batches


def _distributed_mean_loss(params, batch):
  return helpers.safe_mean(helpers.linear_token_losses(params, batch), batch)


def _full_batch_update(batches):
  """sgd(1.0) on the full batch of ``batches``: minus its mean gradient."""
  batch = jax.tree.map(lambda *xs: jnp.concatenate(xs), *batches)
  params = helpers.linear_params(DIM)
  grads = jax.grad(_distributed_mean_loss)(params, batch)
  return jax.tree.map(lambda p, g: p - g, params, grads)


def _local_step(tx):
  def step(params, state, batch, emit):
    grads = jax.grad(_distributed_mean_loss)(oa.device_local(params, "data"),
                                             batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch), emit=emit)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.slow
def test_emit_in_shard_map_reduces_once_per_update():
  tx = oa.accumulate(optax.sgd(1.0), K, axis_name="data")
  batches = _distributed_data(3)
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    params = jax.device_put(helpers.linear_params(DIM), P())
    state = tx.init(params)
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(
        _local_step(tx), in_specs=(P(), specs, P("data"), P()),
        out_specs=(P(), specs),
    ))
    for i, batch in enumerate(batches):  # 3 micro-steps of 4: a partial one.
      batch = jax.device_put(batch, P("data"))
      params, state = step(params, state, batch, jnp.bool_(i == 2))
    counts = oa.count_collectives(
        step.lower(params, state, batch, jnp.bool_(True)).compile())
  assert bool(oa.has_updated(state))
  helpers.assert_trees_close(params, _full_batch_update(batches), rtol=1e-5,
                             atol=1e-6)
  assert counts.total == counts.in_branch == {"all-reduce": 1}


@pytest.mark.slow
def test_emit_in_pmap_reduces_once_per_update():
  tx = oa.accumulate(optax.sgd(1.0), K, axis_name="data")
  batches = _distributed_data(3)
  replicate = lambda t: jax.tree.map(lambda x: jnp.stack([x] * N), t)
  params = replicate(helpers.linear_params(DIM))
  state = replicate(tx.init(helpers.linear_params(DIM)))
  pstep = jax.pmap(_pmap_step(tx), axis_name="data",
                   in_axes=(0, 0, 0, None))
  for i, batch in enumerate(batches):
    batch = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), batch)
    params, state = pstep(params, state, batch, jnp.bool_(i == 2))
  helpers.assert_trees_close(jax.tree.map(lambda p: p[0], params),
                             _full_batch_update(batches), rtol=1e-5,
                             atol=1e-6)
  counts = oa.count_collectives(
      pstep.lower(params, state, batch, jnp.bool_(True)).compile())
  assert counts.total == counts.in_branch == {"all-reduce": 1}


def _pmap_step(tx):
  def step(params, state, batch, emit):
    grads = jax.grad(_distributed_mean_loss)(params, batch)  # local in pmap.
    updates, state = tx.update(grads, state, params,
                               num_tokens=helpers.num_tokens(batch), emit=emit)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.slow
def test_docs_section_prints_what_its_comments_say(capsys):
  """The "End of an epoch and token budgets" blocks, alone, in order."""
  text = (helpers.ROOT / "docs" / "semantics.md").read_text()
  section = text.split("## End of an epoch and token budgets\n")[1]
  blocks = re.findall(r"```python\n(.*?)```", section.split("\n## ")[0], re.S)
  assert len(blocks) == 2
  claimed, namespace = [], {}
  for block in blocks:
    exec(block, namespace)  # pylint: disable=exec-used
    claimed += [line.split("# ")[-1].split(":")[0].strip()
                for line in block.splitlines() if line.startswith("print(")]
  assert capsys.readouterr().out.splitlines() == claimed
