"""Every example's own train step, proven with oa.check_k_invariance.

The examples show that their step follows the full batch by training and
comparing; here each one is run through the check users are told to run on
theirs (docs/proving.md): ``make_step(k)`` is built from the example's own
functions (its loss, its ``num_tokens``, its optimizer, its jitted step
where it has one), at tiny sizes, on a batch whose micro-batches hold uneven
numbers of tokens, and the report must be ``ok``. Where an example builds a
deliberately naive variant (a mean of micro-batch means), that variant must
be reported: the negative control, showing that the batch and the state can
tell the two apart.

Some of the examples' schedules start at a learning rate of 0 (warm-up from
0): there the state is first moved by one update, so that the update checked
moves the parameters too, not only the optimizer's moments.

All in the slow tier (``-m slow``), with the examples' own runs
(test_examples.py): each compiles an example's step once per split, and
``check_k_invariance`` itself is tested in the default tier, on steps of each
form and each planted mistake (tests/unit/proving/).

Not here: examples/plan.py, which plans and checks a gradient but takes no
optimizer step, and the adaptive run of examples/noise_scale/, which ends
its cycles by token count rather than after a given k.
"""

import argparse
import functools

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import helpers
import optax_accum as oa

pytestmark = pytest.mark.slow

K = 4  # micro-batches of the split checked against one (the reference).


def _assert_ok(report):
  assert report.ok, f"\n{report}"


def _assert_reported(report):
  assert not report.ok, f"the naive step passed:\n{report}"
  assert not report.errors, f"\n{report}"  # reported, not raised.


def _committed(*nodes):
  """Commits the arrays of Flax NNX ``nodes`` (in place) or of a pytree.

  The check runs each split on a copy of the state placed where its arrays
  are, so committed to their devices; a warm-up on uncommitted arrays would
  compile the step once more for nothing.
  """
  put = lambda tree: jax.device_put(tree, jax.devices()[0])
  if all(isinstance(node, nnx.Pytree) for node in nodes):
    for node in nodes:
      nnx.update(node, put(nnx.state(node)))
    return None
  (tree,) = nodes
  return put(tree)


def _drop_outputs(step):
  """``step(*state, batch) -> (*state, outputs...)`` as ``state -> state``."""

  def run(state, batch):
    return tuple(step(*state, batch)[:len(state)])

  return run


# scan_train_step.py: one call, oa.value_and_grad over a lax.scan.


def test_scan_train_step_is_k_invariant():
  example = helpers.import_example("scan_train_step")

  def make_step(k):
    if k == 4:  # the example's own jitted step, as it is: its grad_fn has 4.
      train_step = example.train_step
    else:  # the same step around the same oa.value_and_grad at another k.
      grad_fn = oa.value_and_grad(
          example.loss_and_metrics, num_microbatches=k, has_aux=True,
          aux_reduction="mean", num_tokens_fn=lambda mb: mb["mask"].sum())

      @jax.jit
      def train_step(params, opt_state, batch, rng):
        (loss, metrics), grads = grad_fn(params, batch, rng=rng)
        updates, opt_state = example.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    def step(state, batch):
      # rng=None: no dropout, whose masks would depend on the split.
      params, opt_state, *_ = train_step(*state, batch, None)
      return params, opt_state

    return step

  params = example.initial_params()
  state = (params, example.optimizer.init(params))
  report = oa.check_k_invariance(make_step, state, example.example_batch())
  _assert_ok(report)


# no_sync.py: k jitted calls per update on an 8-device mesh.


@pytest.mark.parametrize("variant", ["deferred_step", "naive_step"])
def test_no_sync_micro_steps_are_k_invariant(variant):
  # Both loops of the example are exact: naive_step (jax.grad) only reduces
  # the gradient on every call instead of once per update, so it must pass
  # too; it is not a negative control.
  example = helpers.import_example("no_sync")
  rows = 16  # per micro-batch of the K-split: 2 per device.
  batch = jax.tree.map(lambda *xs: jnp.concatenate(xs),
                       *example.micro_batches(K, rows, dim=4))

  def make_step(k):
    _, micro_step = getattr(example, variant)(k)

    def step(state, batch):
      params, opt_state = state
      for mb in helpers.split(batch, k):
        params, opt_state, _ = micro_step(params, opt_state,
                                          jax.device_put(mb, P("data")))
      return params, opt_state

    return step

  mesh = jax.make_mesh((example.DEVICES,), ("data",),
                       axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    init = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    tx, _ = getattr(example, variant)(1)
    state = (jax.device_put(init, P()), tx.init(init))
    report = oa.check_k_invariance(make_step, state, batch)
  _assert_ok(report)
  assert all(r.ok for r in report.replicas.values()), report.replicas


# resume.py: the micro-step reads its micro-batch by its own counter.


def test_resume_micro_step_is_k_invariant(monkeypatch):
  # The example's micro-step draws its data from its micro-step counter
  # (resume.microbatch), so that a resumed run sees the same data. Here that
  # function is replaced by one that reads micro-step i's rows of the one
  # batch: the same train_micro_step then sees the batch split into k.
  example = helpers.import_example("resume")
  # The example's first K micro-batches, as one batch of uneven halves.
  batch = jax.jit(jax.vmap(example.microbatch))(jnp.arange(K))
  batch = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)

  @functools.cache  # one compilation per k: the warm-up's is the check's.
  def train_micro_step(k):
    size = len(batch["x"]) // k
    monkeypatch.setattr(example, "microbatch", lambda i: jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, i * size, size), batch))
    return example.make_train_micro_step(k)  # traced at its first call.

  def make_step(k):
    def step(state, batch_):
      assert batch_ is batch  # what train_micro_step(k) reads.
      for _ in range(k):
        state, _ = train_micro_step(k)(state)
      return state

    return step

  # One update first: the warm-up's learning rate is 0 at the first one.
  state = make_step(1)(_committed(example.init_train_state(1)), batch)
  state = {**state, "micro_step": jnp.zeros([], jnp.int32)}
  # "micro_step" counts the micro-steps: k of them per update, by design.
  report = oa.check_k_invariance(make_step, state, batch,
                                 ignore=["['micro_step']"])
  _assert_ok(report)


# batchnorm_linen.py: a linen TrainState, oa.value_and_grad(has_state=True).


def _batchnorm_report(norm):
  example = helpers.import_example("batchnorm_linen")
  train_data, _ = example.load_digits(0)
  batch = {name: a[:32] for name, a in train_data.items()}
  momentum = 0.9

  def model(k):  # --match-momentum, the example's default.
    return example.ConvNet(norm=norm, momentum=momentum ** (1 / k))

  def make_step(k):
    train_step = example.make_train_step(model(k), k)
    return lambda state, batch: train_step(state, batch)[0]

  tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 10))
  state = example.create_state(model(1), tx, seed=0)
  ignore = [".batch_stats"] if norm == "batch" else []
  return oa.check_k_invariance(make_step, state, batch, ignore=ignore)


def test_batchnorm_linen_group_norm_twin_is_k_invariant():
  _assert_ok(_batchnorm_report("group"))


def test_batchnorm_linen_batch_norm_is_reported_even_ignoring_its_stats():
  # The example's point: in training BatchNorm normalises each micro-batch by
  # its own statistics, so its gradient is not the full batch's ("ghost batch
  # norm"), which no accumulation can change. Ignoring the running averages
  # (what ignore= is for) leaves the parameters and the optimizer's moments,
  # which differ: this step is reported, and rightly so.
  report = _batchnorm_report("batch")
  _assert_reported(report)
  assert "batch_stats" not in report.worst, f"\n{report}"


# train_lm/: an oa.AccumulatingOptimizer (the naive run: an nnx.Optimizer),
# one nnx.jit call per micro-batch.


def _train_lm_report(naive: bool):
  example = helpers.import_example("train_lm/main")
  train, data = example.train, example.train.data
  seq_len, steps, lr = 32, 10, 3e-3
  verses = data.load_verses()[:64]
  encoded = data.encode(verses, seq_len, seed=0)
  # group_by_length: sorted by tokens, so the micro-batches are uneven.
  warm_up, batch = data.batches(encoded, 8, 2, seed=0, group_by_length=True)

  @functools.cache  # the same tx per k: nnx.jit compiles each k once.
  def make_tx(k):
    tx = train.make_optimizer(steps, lr)
    if naive:
      return optax.MultiSteps(tx, every_k_schedule=k)
    return oa.accumulate(tx, every_k=k)

  def make_step(k):
    def step(state, batch):
      model, optimizer = state
      optimizer.tx = make_tx(k)
      for mb in data.microbatches(batch, k):
        train.micro_step(model, optimizer, mb, token_weighted=not naive)
      return model, optimizer

    return step

  model = train.model_lib.Transformer(
      vocab_size=data.VOCAB_SIZE, seq_len=seq_len, dim=8, num_heads=1,
      num_layers=1, rngs=nnx.Rngs(0))
  optimizer = (nnx.Optimizer if naive else oa.AccumulatingOptimizer)(
      model, make_tx(1), wrt=nnx.Param)
  _committed(model, optimizer)
  # One update first: the warm-up's learning rate is 0 at the first one.
  make_step(1)((model, optimizer), warm_up)
  return oa.check_k_invariance(make_step, (model, optimizer), batch)


def test_train_lm_accumulate_is_k_invariant():
  report = _train_lm_report(naive=False)
  _assert_ok(report)
  assert "[1].step" in dict(report.ignored), report.ignored


def test_train_lm_naive_multisteps_is_reported():
  report = _train_lm_report(naive=True)
  _assert_reported(report)
  assert "weighted by something other" in report.hint, f"\n{report}"


# noise_scale/: accumulate(every_k=None, with_stats=True), emit=True at k.


def test_noise_scale_fixed_k_micro_step_is_k_invariant():
  # The fixed run: target_tokens infinite, the cycle ends after max_k = k
  # micro-batches. (The adaptive run ends its cycles by token count, not
  # after a given k: it has no make_step(k) of its own.)
  example = helpers.import_example("noise_scale/main")
  train, data = example.train, example.train.data
  seq_len = 32
  encoded = data.encode(data.load_verses()[:64], seq_len, seed=0)
  warm_up, batch = data.batches(encoded, 8, 2, seed=0, group_by_length=True)

  def make_step(k):
    def step(state, batch):
      model, optimizer = state
      for mb in data.microbatches(batch, k):
        train.micro_step(model, optimizer, mb, np.float32(np.inf),
                         np.int32(k))
      return model, optimizer

    return step

  model = train.model_lib.Transformer(
      vocab_size=data.VOCAB_SIZE, seq_len=seq_len, dim=8, num_heads=1,
      num_layers=1, rngs=nnx.Rngs(0))
  # One optimizer for every k: every_k=None, the step says when to emit.
  optimizer = nnx.Optimizer(model, train.make_optimizer(3e-3, warmup=1),
                            wrt=nnx.Param)
  _committed(model, optimizer)
  # One update first: the warm-up's learning rate is 0 at the first one.
  make_step(1)((model, optimizer), warm_up)
  report = oa.check_k_invariance(make_step, (model, optimizer), batch)
  _assert_ok(report)
  ignored = dict(report.ignored)
  assert any(path.endswith(".stats") for path in ignored), ignored


# fsdp_tensor/: data x fsdp x tensor mesh, Flax NNX with logical axes.


def test_fsdp_tensor_train_step_is_k_invariant():
  # k = 2, the example's default: 2 rows per data device and micro-batch.
  example = helpers.import_example("fsdp_tensor/main")
  train = example.train
  args = argparse.Namespace(seq_len=16, dim=32, heads=4, layers=1,
                            dropout=0.1, seed=0)
  host_batch = train.data_lib.load_batch(16, args.seq_len, seed=0)
  tx = optax.adamw(3e-3, weight_decay=1e-2)
  with jax.set_mesh(train.make_mesh(train.SHAPE)):
    model = train.make_model(args)
    model.eval()  # dropout off: its masks would depend on the split.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = jax.device_put(host_batch, P(train.DATA_AXES))

    def make_step(k):
      train_step = jax.jit(train.make_train_step(graphdef, tx, k))

      def step(state, batch):
        params, opt_state = state
        params, opt_state, _ = train_step(params, rest, opt_state, batch,
                                          jax.random.key(0))
        return params, opt_state

      return step

    report = oa.check_k_invariance(make_step, (params, tx.init(params)),
                                   batch, num_microbatches=(1, 2))
  _assert_ok(report)
  assert all(r.ok for r in report.replicas.values()), report.replicas


# mesh_2d/: data x model mesh, oa.value_and_grad(axis_name="data").


def _mesh_2d_report(axis_types, naive):
  example = helpers.import_example("mesh_2d/main")
  train = example.train
  tx = optax.adamw(0.02, weight_decay=1e-2)

  def make_step(k):
    if naive:
      value_and_grad = lambda p, b: train.naive_value_and_grad(p, b, k)
    else:  # as train.run_on_mesh builds it.
      value_and_grad = oa.value_and_grad(
          train.model.loss_fn, num_microbatches=k,
          num_tokens_fn=train.data_lib.num_tokens, axis_name="data")
    return _drop_outputs(jax.jit(train.make_train_step(tx, value_and_grad)))

  with jax.set_mesh(train.make_mesh(train.DATA, train.MODEL, axis_types)):
    params = jax.device_put(train.model.init_params(0),
                            train.model.PARAM_SPECS)
    batch = jax.device_put(train.data_lib.make_data(32, seed=0), P("data"))
    return oa.check_k_invariance(make_step, (params, tx.init(params)), batch)


def test_mesh_2d_train_step_is_k_invariant():
  # Auto axes, the example's default (test_distributed.py runs it with
  # Explicit ones too).
  report = _mesh_2d_report("auto", naive=False)
  _assert_ok(report)
  assert all(r.ok for r in report.replicas.values()), report.replicas


def test_mesh_2d_naive_scan_is_reported():
  # naive_value_and_grad sums the k micro-batches' mean losses: k times the
  # gradient (and a mean of means), which the hint names.
  report = _mesh_2d_report("auto", naive=True)
  _assert_reported(report)
  assert "a division is missing" in report.hint, f"\n{report}"


# contrastive/: InfoNCE couples the batch; oa.coupled_value_and_grad.


def _contrastive_report(run):
  example = helpers.import_example("contrastive/main")
  train, data, model = (example.train, example.train.data,
                        example.train.model)
  images, _ = data.split_held_out(data.load_digits(), 64)
  (batch,) = data.batches(images, 32, 1, seed=0)
  optimizer = optax.adam(optax.cosine_decay_schedule(1e-2, 10))

  def make_step(k):
    return _drop_outputs(train.make_steps(k, optimizer)[run])

  params = model.init_params(0, (data.SIDE * data.SIDE, 32, 8))
  state = (params, optimizer.init(params))
  return oa.check_k_invariance(make_step, state,
                               jax.tree.map(jnp.asarray, batch))


def test_contrastive_coupled_is_k_invariant():
  _assert_ok(_contrastive_report("coupled"))


def test_contrastive_naive_per_micro_batch_negatives_is_reported():
  _assert_reported(_contrastive_report("naive"))


# rl_token_level/: sum losses, loss_reduction="sum", num_tokens.


def _rl_report(run):
  example = helpers.import_example("rl_token_level/main")
  args = argparse.Namespace(prompts=4, group=4, max_len=16, seed=0, lr=0.05)
  params = example.init_policy(args.seed)
  # Sorted by completion length: short ones first, uneven micro-batches.
  batch = jax.tree.map(jnp.asarray, example.make_rollouts(params, args))
  opt = example.optimizer(args.lr)

  # The example's training loops keep their optimizer state inside; its
  # micro-steps are rebuilt here from its own pieces, line for line, so
  # that the optimizer's state is in the state the check compares (Adam's
  # first update alone is about lr * sign(gradient), blind to weights).
  def accumulate(k):
    tx = oa.accumulate(opt, every_k=k, loss_reduction="sum")

    @jax.jit
    def micro_step(params, state, microbatch):
      grads = jax.grad(example.sum_loss)(params, microbatch)
      updates, state = tx.update(grads, state, params,
                                 num_tokens=example.num_tokens(microbatch))
      return oa.apply_if_updated(params, updates, state), state

    return tx, micro_step

  def naive(k):
    tx = optax.MultiSteps(opt, every_k_schedule=k)

    @jax.jit
    def micro_step(params, state, microbatch):
      grads = jax.grad(example.naive_mean_loss)(params, microbatch)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return tx, micro_step

  def one_call(k):
    grad_fn = example.one_call_grad_fn(k)

    @jax.jit
    def step(params, opt_state, batch):
      grads = grad_fn(params, batch)[1]
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return opt, step

  build = {"accumulate": accumulate, "naive": naive, "one_call": one_call}[run]

  def make_step(k):
    _, micro_step = build(k)

    def step(state, batch):
      if run == "one_call":
        return micro_step(*state, batch)
      for mb in example.split(batch, k):
        state = micro_step(*state, mb)
      return state

    return step

  tx, _ = build(1)
  return oa.check_k_invariance(make_step, (params, tx.init(params)), batch)


@pytest.mark.parametrize("run", ["accumulate", "one_call"])
def test_rl_token_level_sum_losses_are_k_invariant(run):
  _assert_ok(_rl_report(run))


def test_rl_token_level_naive_mean_per_micro_batch_is_reported():
  report = _rl_report("naive")
  _assert_reported(report)
  assert "weighted by something other" in report.hint, f"\n{report}"

