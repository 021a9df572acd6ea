"""``oa.plan_microbatches``: the choice a brute-force search makes, cheaper.

A brute-force search compiles every candidate (number of micro-batches x
FSDP policy), reads each one's per-device memory and collectives per update,
and takes the smallest ``k`` that fits, communicating least. The planner must
make the same choice at several budgets while compiling fewer candidates, and
plan again without compiling anything. Memory is the peak
(``peak_memory_in_bytes``), or where the backend counts no temporaries in
it (XLA:CPU), temp + arguments + outputs - aliased, flagged.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.compiled import memory_analysis
from optax_accum._src.planner import planner

N = 8  # simulated devices (tests/conftest.py).
CANDIDATES = (1, 2, 4)
ONCE, EVERY = "once", "every_microbatch"
POLICIES = [(s, g) for s in (ONCE, EVERY) for g in (ONCE, EVERY)]
# Activations matter as much as the (FSDP-sharded) weights, so that memory
# falls with k and the policies matter too.
LAYERS, WIDTH, ROWS = 3, 64, 128 * N


def _loss(params, batch):
  h = batch["x"]
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean(h**2)


def _mesh():
  return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))


def _inputs(mesh):
  sds = lambda shape, spec: jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=jax.NamedSharding(mesh, spec))
  return ([sds((WIDTH, WIDTH), P("data"))] * LAYERS,
          {"x": sds((ROWS, WIDTH), P("data"))})


def _brute_force_measure(k, gradient_sync, gather_params):
  """(memory per device, collectives per update) of one compiled candidate."""
  mesh = _mesh()
  fn = oa.value_and_grad(_loss, num_microbatches=k, axis_name="data",
                         gradient_sync=gradient_sync,
                         gather_params=gather_params, equal_weights=True)
  with jax.set_mesh(mesh):
    compiled = jax.jit(fn).lower(*_inputs(mesh)).compile()
  memory = memory_analysis.device_memory(compiled)
  counts = oa.count_collectives(compiled)
  return (
      memory.memory_bytes,
      sum(counts.outside.values()) + k * sum(counts.in_loop.values()),
  )


def _brute_force_choices(measured, budget):
  """Every (k, sync, gather) tied for the choice: smallest k, then least
  communication, then least memory."""
  for k in CANDIDATES:
    fits = {key[1:]: m for key, m in measured.items()
            if key[0] == k and m[0] <= budget}
    if fits:
      best = min((c, mem) for mem, c in fits.values())
      return {(k, *p) for p, (mem, c) in fits.items() if (c, mem) == best}
  return set()


@pytest.fixture(scope="module")
def measured():
  # With k = 1 XLA removes the loop: every policy is the same program, and
  # the planner compiles only the default. Check that claim on two of them.
  out = {(1, ONCE, ONCE): _brute_force_measure(1, ONCE, ONCE)}
  assert _brute_force_measure(1, EVERY, EVERY) == out[1, ONCE, ONCE]
  for k in CANDIDATES[1:]:
    for policy in POLICIES:
      out[(k, *policy)] = _brute_force_measure(k, *policy)
  return out


def _plan(budget):
  mesh = _mesh()
  with jax.set_mesh(mesh):
    return oa.plan_microbatches(
        _loss, *_inputs(mesh), memory_budget=budget, candidates=CANDIDATES,
        axis_name="data", equal_weights=True)


def test_planner_picks_what_brute_force_picks_at_three_budgets(
    measured, monkeypatch):
  memory = {key: m for key, (m, _) in measured.items()}
  at_two = sorted(m for (k, *_), m in memory.items() if k == 2)
  budgets = [memory[1, ONCE, ONCE], at_two[1], min(memory.values())]
  expected = [_brute_force_choices(measured, b) for b in budgets]
  report = {key: f"{m} B, {c} collectives" for key, (m, c) in
            measured.items()}
  # Three different answers, or the test would show little.
  assert len({min(e) for e in expected}) == 3, (budgets, expected, report)
  plans = [_plan(b) for b in budgets]
  for plan, choices, budget in zip(plans, expected, budgets):
    chosen = (plan.num_microbatches, plan.gradient_sync, plan.gather_params)
    assert chosen in choices, (budget, chosen, choices, report)
    assert (plan.memory_bytes, plan.collectives_per_update) == measured[chosen]
    assert plan.memory_bytes <= budget
    # Nothing that cannot win was compiled: no larger k.
    assert max(c.num_microbatches for c in plan.table) == chosen[0]
    for row in plan.table:
      assert (row.memory_bytes, row.collectives_per_update) == measured[
          row[:3]]
  assert len(plans[0].table) == 1  # k = 1 fits: nothing else is compiled.

  # Planning again compiles nothing: every candidate is cached.
  def no_compiling(*args):
    raise AssertionError(f"compiled again: {args}")

  monkeypatch.setattr(planner, "_measure", no_compiling)
  assert _plan(budgets[1])[:3] == plans[1][:3]

  # Nothing fits: the error names the smallest requirement.
  smallest = min(memory.values())
  with pytest.raises(ValueError, match=f"the smallest needs {smallest} bytes"):
    _plan(smallest - 1)


def test_plan_runs_and_its_table_prints_aligned(measured):
  budget = min(m for (k, *_), (m, _) in measured.items() if k == 2)
  plan = _plan(budget)
  lines = str(plan.table).splitlines()
  assert len(lines) == 1 + len(plan.table)
  assert lines[0].split()[:4] == ["k", "gradient_sync", "gather_params",
                                  "memory/device"]
  column = lines[0].index("gradient_sync")
  for line, row in zip(lines[1:], plan.table):
    assert line.index(row.gradient_sync, 3) == column, lines
    assert line.endswith("yes" if row.fits else "no")
    # A memory read as temp + args (XLA:CPU here) says so.
    assert (f"({memory_analysis.TEMP_AND_ARGS})" in line) == (
        row.memory_measure == memory_analysis.TEMP_AND_ARGS), line
  chosen, = (row for row in plan.table if row[:3] == plan[:3])
  assert plan.memory_measure == chosen.memory_measure
  # The plan's step is an ordinary oa.value_and_grad: it compiles and runs.
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params, batch = jax.tree.map(
        lambda s: jnp.ones(s.shape, s.dtype, out_sharding=s.sharding),
        _inputs(mesh))
    loss, _ = jax.jit(plan.value_and_grad)(params, batch)
    expected_loss = jax.jit(_loss)(params, batch)
  assert jnp.allclose(loss, expected_loss, rtol=1e-5)


def test_without_sharded_params_only_the_default_policy_is_compiled():
  mesh = _mesh()
  params = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32,
                                 sharding=jax.NamedSharding(mesh, P()))]
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match="No candidate fits") as error:
      oa.plan_microbatches(_loss, params, _inputs(mesh)[1], memory_budget=1,
                           candidates=(2,), axis_name="data",
                           equal_weights=True)
  table = str(error.value).splitlines()[1:]
  assert len(table) == 2 and "every_microbatch" not in table[1], table


def test_bad_arguments_are_named_before_compiling():
  mesh = _mesh()
  with jax.set_mesh(mesh):
    params, batch = _inputs(mesh)
    with pytest.raises(ValueError, match="memory_budget must be a positive"):
      oa.plan_microbatches(_loss, params, batch, memory_budget=0)
    with pytest.raises(TypeError, match="chooses num_microbatches"):
      oa.plan_microbatches(_loss, params, batch, memory_budget=1,
                           num_microbatches=2)
    with pytest.raises(ValueError, match="divisors of the per-device batch"):
      oa.plan_microbatches(_loss, params, batch, memory_budget=1,
                           candidates=(3,), axis_name="data")
    with pytest.raises(TypeError, match=r"candidates must be None or an"
                       r" iterable.*pass \[4\]"):
      oa.plan_microbatches(_loss, params, batch, memory_budget=1,
                           candidates=4, axis_name="data")
    with pytest.raises(ValueError, match="at least one number"):
      oa.plan_microbatches(_loss, params, batch, memory_budget=1,
                           candidates=[], axis_name="data")
  # Unsharded inputs carry no mesh: outside jax.set_mesh there is none.
  host = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
  with pytest.raises(ValueError, match=r"jax\.set_mesh"):
    oa.plan_microbatches(_loss, *host, memory_budget=1, axis_name="data")


@pytest.mark.slow  # examples/plan.py end to end: the slow tier's.
def test_plan_example_prints_a_plan_per_budget(capsys):
  example = helpers.import_example("plan")
  result = example.main([
      "--budgets-mib", "1000", "0.001", "--layers", "1", "--dim", "32",
      "--vocab", "64", "--seq-len", "8", "--batch-size", "16",
      "--max-microbatches", "1",
  ])
  first, second = result["plans"].values()
  assert first.num_microbatches == 1 and second is None
  printed = capsys.readouterr().out
  assert "memory_budget = 1000 MiB per device" in printed
  assert "No candidate fits memory_budget=1048 bytes" in printed
  assert "gradient sharded like the parameters: True" in printed


def _plan_and_run(loss_fn, operands, expected_fn, **kwargs):
  """Plans at k=2 (a generous budget), runs the plan, compares to the batch."""
  call = {key: kwargs.pop(key) for key in ("rng",) if key in kwargs}
  loss_kwargs = kwargs.get("loss_kwargs") or {}
  plan = oa.plan_microbatches(loss_fn, *operands, memory_budget=2**30,
                              candidates=(2,), **kwargs, **call)
  assert plan.num_microbatches == 2
  value, grads = jax.jit(plan.value_and_grad)(*operands, **call, **loss_kwargs)
  helpers.assert_trees_close((value, grads), expected_fn(), rtol=1e-5,
                             atol=1e-6)


def test_the_plan_takes_args_rng_and_keyword_arguments():
  w, batch = jnp.full((4,), 0.3), {"x": jnp.arange(32.0).reshape(8, 4) / 10}

  def loss(w, mb, scale, *, rng, power):
    del rng  # taken, as a dropout model would; the gradient is exact.
    return jnp.mean(jnp.tanh(mb["x"] @ w * scale) ** power)

  _plan_and_run(
      loss, (w, batch, 2.0),
      lambda: jax.value_and_grad(loss)(w, batch, 2.0, rng=None, power=2),
      rng=jax.random.key(0), loss_kwargs={"power": 2}, equal_weights=True)


def test_the_plan_threads_model_state():
  w, state = jnp.full((4,), 0.3), jnp.zeros([])
  batch = {"x": jnp.arange(32.0).reshape(8, 4) / 10}

  def loss(w, state, mb):
    return jnp.mean(jnp.tanh(mb["x"] @ w) ** 2), state + 1.0

  plan = oa.plan_microbatches(loss, w, state, batch, memory_budget=2**30,
                              candidates=(2,), has_state=True,
                              equal_weights=True)
  (value, new_state), grads = plan.value_and_grad(w, state, batch)
  assert float(new_state) == 2.0  # one step per micro-batch.
  full = jax.value_and_grad(lambda w: loss(w, state, batch)[0])(w)
  helpers.assert_trees_close((value, grads), full, rtol=1e-5)


def test_a_coupled_loss_is_planned_with_encode_fn():
  w, x = jnp.ones((2, 3)), jnp.arange(8.0).reshape(4, 2)
  encode = lambda w, x: x @ w
  loss = lambda w, reps, x: jnp.sum(reps**2) / jnp.sum(jnp.abs(reps))
  _plan_and_run(loss, (w, x),
                lambda: jax.value_and_grad(lambda w: loss(w, encode(w, x),
                                                          x))(w),
                encode_fn=encode)


def test_a_shard_map_step_is_planned_with_wrap():
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  w, batch = jnp.full((4,), 0.3), {"x": jnp.arange(64.0).reshape(16, 4) / 10}
  loss = lambda w, mb: jnp.mean(jnp.tanh(mb["x"] @ w) ** 2)
  wrap = lambda fn: jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("data")),
                                  out_specs=P())
  plan = oa.plan_microbatches(loss, w, batch, memory_budget=2**30,
                              candidates=(1,), wrap=wrap, axis_name="data",
                              equal_weights=True)
  counts = plan.table[0].collectives
  assert counts.total == {"all-reduce": 1}, counts  # the one reduction.
  value, grads = jax.jit(wrap(plan.value_and_grad))(w, batch)
  helpers.assert_trees_close((value, grads),
                             jax.value_and_grad(loss)(w, batch), rtol=1e-5)
