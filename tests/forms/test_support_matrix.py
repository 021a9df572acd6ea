"""The support matrix: every entry point in every parallel form and mesh.

A pairwise covering (``helpers.pairwise_cover``) of entry point x form x mesh
x parameter layout x batch layout x feature: every pair of values that can go
together is run at least once. Each cell compares the loss and gradient with
the one-device full batch (``jax.value_and_grad`` of the token-weighted mean
on host arrays), checks that the gradient comes back sharded like the
parameters, and reads the compiled program's collectives: with a data axis,
no all-reduce or reduce-scatter over it inside the micro-batch loop unless
``gradient_sync="every_microbatch"`` asks for one.

``docs/support_matrix.md`` holds the table that
:func:`render_table` makes of these cells; regenerate it, from the repository
root, with ``PYTHONPATH=tests/support python
tests/forms/test_support_matrix.py`` (helpers is in tests/support).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import helpers
import optax_accum as oa
from optax_accum._src.mesh import readers

K = 2  # micro-batches per device.
BATCH, SEQ, DIM, HIDDEN = 32, 4, 8, 8
DOC = helpers.ROOT / "docs" / "support_matrix.md"

ENTRIES = ("value_and_grad", "coupled_value_and_grad", "plan_microbatches")
# The forms of docs/distributed.md, by how the call is made.
ONE_DEVICE = "single: one device"
AUTO = "auto: jit + set_mesh"
TYPED = "typed: jit + set_mesh"
TYPED_INPUTS = "typed: jit, the inputs' mesh"
SHARD_MAP = "manual: shard_map"
PMAP = "manual: pmap"
FORMS = (ONE_DEVICE, AUTO, TYPED, TYPED_INPUTS, SHARD_MAP, PMAP)
PARAMS = ("replicated", "FSDP", "tensor-parallel", "FSDP + tensor-parallel")
BATCHES = ("sharded", "replicated", "-")
FEATURES = ("num_tokens_fn, empty micro-batch", 'aux_reduction="mean"',
            "rng=", "has_state", "with_stats", "batch_axes None leaf",
            'gradient_sync="every_microbatch"',
            'gather_params="every_microbatch"', "bfloat16 params")


@dataclasses.dataclass(frozen=True)
class Mesh:
  """A mesh of the matrix: its axes, data axes and what shards parameters."""

  shape: tuple[int, ...]
  names: tuple[str, ...]
  axis_name: str | tuple[str, ...]  # the data axes passed as axis_name.
  fsdp: str | tuple[str, ...]  # the data axes FSDP parameters shard over.
  tensor: str | None  # the axis tensor-parallel parameters shard over.


MESHES = {
    "-": None,  # one device.
    "(8,) data": Mesh((8,), ("data",), "data", "data", None),
    "(2, 4) data x model": Mesh(
        (2, 4), ("data", "model"), "data", "data", "model"),
    # Flax lm1b's one-host layout: the data axis has size 1.
    "(1, 8) data x fsdp": Mesh(
        (1, 8), ("data", "fsdp"), "data", "data", "fsdp"),
    "(2, 2, 2) data x fsdp x tensor": Mesh(
        (2, 2, 2), ("data", "fsdp", "tensor"), ("data", "fsdp"),
        ("data", "fsdp"), "tensor"),
    "(4, 2) replica x fsdp (HSDP)": Mesh(
        (4, 2), ("replica", "fsdp"), ("replica", "fsdp"), "fsdp", None),
}

DIMENSIONS = {
    "entry": ENTRIES, "form": FORMS, "mesh": tuple(MESHES),
    "params": PARAMS, "batch": BATCHES, "feature": FEATURES,
}


def not_applicable(cell) -> str | None:
  """Why a combination means nothing (it is left out), or None."""
  entry, form, feature = cell["entry"], cell["form"], cell["feature"]
  mesh = MESHES[cell["mesh"]]
  one_device = form == ONE_DEVICE
  if one_device != (mesh is None):
    return "one device has no mesh, every other form has one"
  if one_device and (cell["params"], cell["batch"]) != ("replicated", "-"):
    return "one device: nothing is sharded"
  if not one_device and cell["batch"] == "-":
    return "a mesh's batch is sharded or replicated"
  if form == PMAP and (entry != "value_and_grad"
                         or cell["mesh"] != "(8,) data"
                         or cell["params"] != "replicated"
                         or cell["batch"] != "sharded"):
    return ("pmap: value_and_grad, one axis, replicated parameters, the"
            " batch mapped")
  if form == SHARD_MAP and cell["batch"] != "sharded":
    return "inside shard_map the batch is this device's shard"
  if "tensor" in cell["params"] and (mesh is None or mesh.tensor is None):
    return "the mesh has no axis besides the data axes"
  if entry == "coupled_value_and_grad" and feature in (
      'aux_reduction="mean"', "has_state", "with_stats",
      'gradient_sync="every_microbatch"', 'gather_params="every_microbatch"'):
    return "coupled_value_and_grad has no such argument"
  if "every_microbatch" in feature and (
      entry != "value_and_grad" or "FSDP" not in cell["params"]):
    return ("the policies apply to value_and_grad with parameters sharded"
            " over a data axis (the planner chooses them: REFUSED_CELLS)")
  return None


CELLS = helpers.pairwise_cover(
    DIMENSIONS, lambda cell: not_applicable(cell) is None)

# Combinations that the library refuses with its own error, run next to
# the covering (they cover no pair): {cell id: (error type, message words)}.
_PLANNED = dict(entry="plan_microbatches", form=TYPED,
                mesh="(8,) data", params="FSDP", batch="sharded")
REFUSED_CELLS = [
    dict(_PLANNED, feature='gradient_sync="every_microbatch"'),
    dict(_PLANNED, feature='gather_params="every_microbatch"'),
]


def cell_id(cell) -> str:
  return "|".join(cell[name] for name in DIMENSIONS)


REFUSED = {
    cell_id(REFUSED_CELLS[0]): (
        TypeError, "plan_microbatches chooses gradient_sync"),
    cell_id(REFUSED_CELLS[1]): (
        TypeError, "plan_microbatches chooses gather_params"),
}
# Cells that fail for a reason not yet fixed: {cell id: reason}.
XFAIL = {}


# The model: a 2-layer tanh MLP on padded sequences, token-weighted.


def _lengths(feature):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, SEQ + 1, size=BATCH)  # uneven, never empty.
  if feature == "num_tokens_fn, empty micro-batch":
    lengths[:BATCH // 2] = 0  # every form's first micro-batch somewhere.
  return lengths


@functools.cache
def _host_inputs(feature):
  """Host (numpy) parameters and batch of a feature's cells."""
  rng = np.random.default_rng(1)
  batch = helpers.padded_batch(rng, _lengths(feature), SEQ, DIM)
  if feature == "batch_axes None leaf":
    batch["scale"] = np.float32(1.7)
  params = {
      "w1": rng.normal(size=(DIM, HIDDEN)).astype(np.float32),
      "b1": (rng.normal(size=HIDDEN) * 0.1).astype(np.float32),
      "w2": rng.normal(size=HIDDEN).astype(np.float32),
  }
  if feature == "bfloat16 params":
    params = jax.tree.map(lambda p: np.asarray(p, jnp.bfloat16), params)
  return params, batch


def token_losses(params, mb, keep=None, rng=None):
  """Per-token squared error, masked; dropout on the hidden layer with rng."""
  dtype = params["w1"].dtype
  hidden = jnp.tanh(helpers.add_bias(mb["x"].astype(dtype) @ params["w1"],
                                     params["b1"]))
  if rng is not None:
    hidden = jnp.where(jax.random.bernoulli(rng, keep, hidden.shape),
                       hidden / keep.astype(dtype), 0)
  rows = readers.explicit_spec(mb["y"])
  if rows is None:
    pred = (hidden * params["w2"]).sum(-1)
  else:  # written for jax.jit: a contraction JAX types with w2 reduced.
    pred = jnp.einsum("bsh,h->bs", hidden, params["w2"], out_sharding=rows)
  pred = pred.astype(jnp.float32)
  losses = mb["mask"] * (pred - mb["y"]) ** 2
  return losses * mb["scale"] if "scale" in mb else losses


def _hits(params, mb):
  err = token_losses(params, mb)
  return (mb["mask"] * (err < 1.0)).sum() / jnp.maximum(mb["mask"].sum(), 1)


def _mean(losses, mb, feature):
  if feature == "num_tokens_fn, empty micro-batch":
    return helpers.raw_mean(losses, mb)  # 0/0 = NaN on an empty micro-batch.
  return helpers.safe_mean(losses, mb)


def _loss_fn(feature):
  """``loss_fn`` of value_and_grad (and the planner) for a feature."""
  if feature == "rng=":
    return lambda p, mb, keep, *, rng: _mean(
        token_losses(p, mb, keep, rng), mb, feature)
  if feature == "has_state":
    return lambda p, state, mb: (
        _mean(token_losses(p, mb), mb, feature),
        {"count": state["count"] + 1.0})
  if feature == 'aux_reduction="mean"':
    return lambda p, mb: (_mean(token_losses(p, mb), mb, feature),
                          {"hits": _hits(p, mb)})
  return lambda p, mb: _mean(token_losses(p, mb), mb, feature)


def _encode_fn(p, mb, *args, rng=None):
  """Coupled: each row's loss sum and token count."""
  keep = args[0] if args else None
  return {"sum": token_losses(p, mb, keep, rng).sum(-1),
          "tokens": mb["mask"].sum(-1)}


def _coupled_loss_fn(p, reps, batch, *args):
  del p, batch, args
  return reps["sum"].sum() / reps["tokens"].sum()  # a batch-wide normaliser.


@functools.cache
def _reference(feature):
  """The one-device full batch's loss, gradient and aux, in float32."""
  params, batch = _host_inputs(feature)
  params = jax.tree.map(lambda p: np.asarray(p, np.float32), params)

  def loss(p):
    return helpers.safe_mean(token_losses(p, batch), batch)

  value, grads = jax.value_and_grad(loss)(params)
  return value, grads, _hits(params, batch)


# The forms.


def _full_specs(cell):
  """Each parameter's full PartitionSpec on the cell's mesh."""
  mesh, layout = MESHES[cell["mesh"]], cell["params"]
  fsdp = mesh.fsdp if "FSDP" in layout else None
  tensor = mesh.tensor if "tensor" in layout else None
  return {"w1": P(fsdp, tensor), "b1": P(tensor), "w2": P(tensor or fsdp)}


def _data_part(spec, mesh):
  """A spec's entries over the data axes only (shard_map's in_specs)."""
  data = set(_names(mesh.axis_name))
  entries = []
  for e in spec:
    kept = tuple(a for a in _names(e) if a in data) if e else ()
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*entries)


def _names(name):
  return name if isinstance(name, tuple) else (name,)


def _batch_spec(cell, batch):
  mesh = MESHES[cell["mesh"]]
  rows = P(mesh.axis_name) if cell["batch"] == "sharded" else P()
  return {k: P() if k == "scale" else rows for k in batch}


def _options(cell):
  """The entry point's keyword arguments for a cell."""
  feature, form = cell["feature"], cell["form"]
  mesh = MESHES[cell["mesh"]]
  opts = {}
  if form != ONE_DEVICE:
    opts["axis_name"] = mesh.axis_name
  if form == AUTO:  # Auto types do not carry the layout.
    opts["param_specs"] = _full_specs(cell)
  elif form == SHARD_MAP:
    opts["param_specs"] = jax.tree.map(
        lambda s: _data_part(s, mesh), _full_specs(cell),
        is_leaf=lambda x: isinstance(x, P))
  if feature == "batch_axes None leaf":
    opts["batch_axes"] = {"x": 0, "y": 0, "mask": 0, "scale": None}
  if cell["entry"] == "coupled_value_and_grad":
    return opts
  opts["num_tokens_fn"] = helpers.num_tokens
  if feature == 'aux_reduction="mean"':
    opts.update(has_aux=True, aux_reduction="mean")
  elif feature == "has_state":
    opts["has_state"] = True
  elif feature == "with_stats":
    opts["with_stats"] = True
  elif feature.startswith("gradient_sync"):  # refused by the planner.
    opts["gradient_sync"] = "every_microbatch"
  elif feature.startswith("gather_params"):
    opts["gather_params"] = "every_microbatch"
  return opts


def _unpack(cell, out):
  """``(loss, grads, aux, state, stats)`` of an entry point's output."""
  feature = cell["feature"]
  stats = None
  if feature == "with_stats" and cell["entry"] != "coupled_value_and_grad":
    value, grads, stats = out
  else:
    value, grads = out
  loss, aux, state = value, None, None
  if feature == 'aux_reduction="mean"':
    loss, aux = value
  elif feature == "has_state":
    loss, state = value
  return loss, grads, aux, state, stats


def _step_fn(fn):
  """``step(params, state, batch, args, key)``, positional, of ``fn``."""

  def step(params, state, batch, args, key):
    lead = (params,) if state is None else (params, state)
    kwargs = {} if key is None else {"rng": key}
    return fn(*lead, batch, *args, **kwargs)

  return step


def _entry_fn(cell, operands, context):
  """The cell's value-and-grad function (planned, for the planner)."""
  opts = _options(cell)
  if cell["entry"] == "coupled_value_and_grad":
    return oa.coupled_value_and_grad(
        _encode_fn, _coupled_loss_fn, num_microbatches=K, **opts)
  loss_fn = _loss_fn(cell["feature"])
  if cell["entry"] == "value_and_grad":
    return oa.value_and_grad(loss_fn, num_microbatches=K, **opts)
  params, state, batch, args, key = operands
  lead = (params,) if state is None else (params, state)
  with context():
    plan = oa.plan_microbatches(
        loss_fn, *lead, batch, *args, memory_budget=2**40, candidates=(K,),
        rng=key, wrap=_planner_wrap(cell), **opts)
  assert plan.num_microbatches == K, plan.table
  return plan.value_and_grad


def _planner_wrap(cell):
  """The planner's ``wrap=``: the step inside the cell's shard_map."""
  if cell["form"] != SHARD_MAP:
    return None
  return lambda fn: _planner_shard_map(cell, _mesh(cell), fn)


def _planner_shard_map(cell, mesh, fn):
  """The planner's wrap: ``fn(params, [state,] batch, *args, rng=)``."""

  def run(*operands, rng=None):
    has_state = cell["feature"] == "has_state"
    params, state = operands[0], operands[1] if has_state else None
    batch = operands[2 if has_state else 1]
    args = operands[3 if has_state else 2:]
    return _shard_map(cell, mesh, _step_fn(fn))(
        params, state, batch, args, rng)

  return run


def _mesh(cell):
  mesh = MESHES[cell["mesh"]]
  kind = (AxisType.Auto if cell["form"] == AUTO
          else AxisType.Explicit)
  return jax.make_mesh(mesh.shape, mesh.names,
                       axis_types=(kind,) * len(mesh.shape))


def _out_specs(cell, data_specs):
  feature = cell["feature"]
  aux = P() if feature == 'aux_reduction="mean"' else None
  value = P()
  if aux is not None:
    value = (P(), aux)
  elif feature == "has_state":
    value = (P(), P())
  out = (value, data_specs)
  if feature == "with_stats" and cell["entry"] != "coupled_value_and_grad":
    out += (P(),)
  return out


def _shard_map(cell, mesh, step):
  """``step`` in a shard_map over the cell's data axes."""
  m = MESHES[cell["mesh"]]
  data_specs = jax.tree.map(lambda s: _data_part(s, m), _full_specs(cell),
                            is_leaf=lambda x: isinstance(x, P))
  _, host_batch = _host_inputs(cell["feature"])
  return jax.shard_map(
      step, mesh=mesh,
      in_specs=(data_specs, P(), _batch_spec(cell, host_batch), P(), P()),
      out_specs=_out_specs(cell, data_specs),
      axis_names=set(_names(m.axis_name)))


def _pmap(step, batch):
  batch_axes = {k: None if k == "scale" else 0 for k in batch}
  return jax.pmap(step, axis_name="data",
                  in_axes=(None, None, batch_axes, None, None))


def _place(cell, mesh, tree, specs):
  return jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def _operands(cell, mesh, keep):
  """``(params, state, batch, args, key)`` laid out for the cell's form."""
  feature = cell["feature"]
  params, batch = _host_inputs(feature)
  state = {"count": np.float32(0)} if feature == "has_state" else None
  args = (np.float32(keep),) if feature == "rng=" else ()
  key = _key(0) if feature == "rng=" else None
  if cell["form"] == PMAP:
    batch = {k: x if k == "scale" else x.reshape((8, -1) + x.shape[1:])
             for k, x in batch.items()}
    return params, state, batch, args, key
  if mesh is None:
    return params, state, batch, args, key
  params = _place(cell, mesh, params, _full_specs(cell))
  batch = _place(cell, mesh, batch, _batch_spec(cell, batch))
  replicated = lambda t: _place(cell, mesh, t, jax.tree.map(lambda _: P(), t))
  return params, replicated(state), batch, replicated(args), (
      None if key is None else replicated(key))


def _key(seed):
  # An "rbg" key compiles in a fraction of threefry's time on CPU.
  return jax.random.key(seed, impl="rbg")


def _contexts(cell, mesh):
  """The context the cell's step is traced, compiled and run in."""
  if mesh is None or cell["form"] in (PMAP, TYPED_INPUTS):
    return contextlib.nullcontext
  return lambda: jax.set_mesh(mesh)


# The steps are tiny: LLVM's optimisations cost more time than they save (a
# third of the compile). XLA's own passes, which place the collectives, run.
_QUICK = {"xla_backend_optimization_level": 0,
          "xla_llvm_disable_expensive_passes": True}


def _compiled(cell, mesh, operands, context):
  """The compiled step of the cell (one compilation) and its entry fn."""
  fn = _entry_fn(cell, operands, context)
  step = _step_fn(fn)
  if cell["form"] == SHARD_MAP:
    step = _shard_map(cell, mesh, step)
  elif cell["form"] == PMAP:
    return _pmap(step, operands[2]).lower(*operands).compile(_QUICK)
  with context():
    return jax.jit(step).lower(*operands).compile(_QUICK)


def _tolerance(feature):
  return (dict(rtol=3e-2, atol=3e-2) if feature == "bfloat16 params"
          else dict(rtol=2e-5, atol=2e-6))


def _check_values(cell, out):
  feature = cell["feature"]
  loss, grads, aux, state, stats = _unpack(cell, out)
  if cell["form"] == PMAP:
    loss, grads, aux, state, stats = jax.tree.map(
        lambda x: x[0], (loss, grads, aux, state, stats))
  ref_loss, ref_grads, ref_hits = _reference(feature)
  tol = _tolerance(feature)
  np.testing.assert_allclose(np.float32(loss), ref_loss, **tol)
  grads32 = jax.tree.map(lambda g: np.asarray(g, np.float32), grads)
  helpers.assert_trees_close(grads32, ref_grads, **tol)
  params, _ = _host_inputs(feature)
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)):
    assert g.dtype == p.dtype, (g.dtype, p.dtype)
  if aux is not None:
    np.testing.assert_allclose(aux["hits"], ref_hits, rtol=1e-5)
  if state is not None:
    np.testing.assert_allclose(state["count"], float(K))
  if stats is not None:
    # grad_sq_norm + trace_cov / N is |g|^2, the full gradient's (sharded
    # gradients' squares summed once).
    _, batch = _host_inputs(feature)
    total = float(batch["mask"].sum())
    sq = sum(float((g ** 2).sum()) for g in jax.tree.leaves(ref_grads))
    np.testing.assert_allclose(
        float(stats.grad_sq_norm) + float(stats.trace_cov) / total, sq,
        rtol=1e-4)
    mesh = MESHES[cell["mesh"]]
    devices = 1 if mesh is None else int(np.prod(
        [mesh.shape[mesh.names.index(a)] for a in _names(mesh.axis_name)]))
    # Each device's micro-batches (its rows of each micro-batch in the
    # typed form: SPEC 6) are the small batches.
    assert float(stats.num_microbatches) == K * devices, stats


def _typed(cell):
  """Whether a cell runs in the typed form: jit with Explicit data axes."""
  return cell["form"] in (TYPED, TYPED_INPUTS) and (
      MESHES[cell["mesh"]] is not None)


def _normalized(spec, ndim):
  entries = list(spec) + [None] * (ndim - len(spec))
  return tuple(_names(e) if e is not None else None for e in entries)


def _check_sharding(cell, mesh, grads):
  if mesh is None or cell["form"] == PMAP:
    return
  specs = _full_specs(cell)
  for name, g in grads.items():
    want = _normalized(specs[name], g.ndim)
    got = _normalized(g.sharding.spec, g.ndim)
    if cell["form"] == AUTO:
      assert g.sharding.is_equivalent_to(
          NamedSharding(mesh, specs[name]), g.ndim), (name, got, want)
    else:
      assert got == want, (name, got, want)


def _check_collectives(cell, compiled):
  """No gradient reduction (or gather) over a data axis in the loop.

  Unless ``gradient_sync`` (``gather_params``) ``="every_microbatch"`` asks
  for one, with parameters sharded over a data axis: then there must be one.
  Collectives over other axes (tensor parallelism) are the model's own.
  """
  mesh = MESHES[cell["mesh"]]
  if mesh is None:
    return
  data = {a for a in _names(mesh.axis_name)
          if mesh.shape[mesh.names.index(a)] > 1}
  # The loss's and token count's scalars aside: the typed form sums them
  # over the global micro-batch, as jax.jit of the full batch does.
  counts = helpers.loop_collectives_by_axes(
      compiled, mesh.shape, mesh.names, include_scalars=False)
  over_data = {op for (op, spanned), _ in counts.items() if data & set(spanned)}
  fsdp = "FSDP" in cell["params"] and data & set(_names(mesh.fsdp))
  asked = cell["feature"].startswith("gradient_sync") and fsdp
  if asked and _typed(cell):  # XLA on CPU: an all-reduce and a slice.
    assert over_data & {"reduce-scatter", "all-reduce"}, counts
  else:
    assert ("reduce-scatter" in over_data) == bool(asked), counts
    assert ("all-reduce" in over_data) is False, counts
  asked = cell["feature"].startswith("gather_params") and fsdp
  assert ("all-gather" in over_data) == bool(asked), counts


def _run(cell):
  mesh = None if MESHES[cell["mesh"]] is None or cell["form"] == PMAP else (
      _mesh(cell))
  context = _contexts(cell, mesh)
  operands = _operands(cell, mesh, keep=1.0)
  compiled = _compiled(cell, mesh, operands, context)
  with context():
    out = compiled(*operands)
  _check_values(cell, out)
  _check_sharding(cell, mesh, _unpack(cell, out)[1])
  _check_collectives(cell, compiled)
  if cell["feature"] == "rng=":
    _check_rng(cell, mesh, compiled, context)


def _check_rng(cell, mesh, compiled, context):
  """Dropout: the same key gives the same result, another key another."""
  operands = _operands(cell, mesh, keep=0.5)
  other = list(operands)
  other[4] = jax.device_put(_key(1), operands[4].sharding) if (
      mesh is not None and cell["form"] != PMAP) else _key(1)
  with context():
    first, again, moved = (
        np.ravel(_unpack(cell, compiled(*o))[0])[0]
        for o in (operands, operands, other))
  assert float(first) == float(again)
  assert float(first) != float(moved)
  assert float(first) != float(_reference(cell["feature"])[0])


def first_of_each_value(cells) -> list[dict]:
  """The cells that, in order, are the first to hold a value of a dimension."""
  seen, first = set(), []
  for cell in cells:
    if not set(cell.items()) <= seen:
      first.append(cell)
      seen |= set(cell.items())
  return first


# Every value of every dimension (entry point, form, mesh, layouts, feature)
# runs in every test run, in the first covering cell that holds it; the rest
# of the covering (every pair) runs in the slow tier (-m slow).
_EVERY_RUN = {cell_id(c) for c in first_of_each_value(CELLS)}


@pytest.mark.parametrize("cell", [
    c if cell_id(c) in _EVERY_RUN or c in REFUSED_CELLS
    else pytest.param(c, marks=pytest.mark.slow)
    for c in CELLS + REFUSED_CELLS],
                         ids=[cell_id(c) for c in CELLS + REFUSED_CELLS])
def test_support_matrix(cell):
  key = cell_id(cell)
  if key in XFAIL:
    pytest.xfail(XFAIL[key])
  if key in REFUSED:
    kind, words = REFUSED[key]
    with pytest.raises(kind, match=words):
      _run(cell)
    return
  _run(cell)


def test_loop_collectives_tell_a_naive_scans_data_reductions():
  """Negative control: a scan of jax.grad reduces over "data" in the loop."""
  cell = dict(entry="value_and_grad", form=TYPED,
              mesh="(2, 4) data x model", params="tensor-parallel",
              batch="sharded", feature="has_state")
  mesh = _mesh(cell)
  params, _, batch, _, _ = _operands(cell, mesh, keep=1.0)

  def naive(params, batch):
    split = jax.tree.map(
        lambda x: x.reshape((-1, K) + x.shape[1:]).swapaxes(0, 1), batch)

    def step(total, mb):
      grads = jax.grad(lambda p: helpers.safe_mean(token_losses(p, mb), mb))(
          params)
      return jax.tree.map(jnp.add, total, grads), None

    return jax.lax.scan(step, jax.tree.map(jnp.zeros_like, params), split)[0]

  with jax.set_mesh(mesh):
    compiled = jax.jit(naive).lower(params, batch).compile(_QUICK)
  counts = helpers.loop_collectives_by_axes(compiled, (2, 4),
                                            ("data", "model"))
  assert any(op == "all-reduce" and "data" in spanned
             for op, spanned in counts), counts
  with pytest.raises(AssertionError):
    _check_collectives(cell, compiled)


def test_the_cells_of_every_run_hold_every_value_of_the_covering():
  for name in DIMENSIONS:
    assert ({c[name] for c in first_of_each_value(CELLS)}
            == {c[name] for c in CELLS}), name
  assert len(_EVERY_RUN) < len(CELLS) / 2


def test_pairwise_cover_covers_every_allowed_pair_with_few_cells():
  dims = {"a": (0, 1, 2), "b": (0, 1, 2), "c": (0, 1), "d": (0, 1)}
  allowed = lambda c: not (c["a"] == 2 and c["b"] == 2)
  cells = helpers.pairwise_cover(dims, allowed)
  assert all(allowed(c) for c in cells)
  names = list(dims)
  for i, x in enumerate(names):
    for y in names[i + 1:]:
      for vx in dims[x]:
        for vy in dims[y]:
          wanted = not (x, y, vx, vy) == ("a", "b", 2, 2)
          held = any(c[x] == vx and c[y] == vy for c in cells)
          assert held == wanted, (x, vx, y, vy)
  assert len(cells) <= 12  # the product has 36 cells, 32 allowed.
  assert cells == helpers.pairwise_cover(dims, allowed)  # deterministic.


# The table of docs/support_matrix.md.

REGENERATE = ("PYTHONPATH=tests/support python"
              " tests/forms/test_support_matrix.py")
_BEGIN = f"<!-- support-matrix: begin ({REGENERATE}) -->"
_END = "<!-- support-matrix: end -->"
_SHORT = {"value_and_grad": "V", "coupled_value_and_grad": "C",
          "plan_microbatches": "P"}


def outcome(cell) -> str:
  """What the test expects of a cell, in the table's words."""
  key = cell_id(cell)
  if key in REFUSED:
    kind, words = REFUSED[key]
    return f"refused: {kind.__name__} ({words})"
  if key in XFAIL:
    return f"fails: {XFAIL[key]}"
  return "exact"


def _summary() -> list[str]:
  meshes = list(MESHES)
  rows = ["| form | " + " | ".join(m if m != "-" else "one device"
                                    for m in meshes) + " |",
          "|---" * (len(meshes) + 1) + "|"]
  for form in FORMS:
    entries = []
    for mesh in meshes:
      ran = [c for c in CELLS if (c["form"], c["mesh"]) == (form, mesh)]
      letters = sorted({_SHORT[c["entry"]] for c in ran
                        if outcome(c) == "exact"}, key="VCP".index)
      entries.append(" ".join(letters) or "n/a")
    rows.append(f"| {form} | " + " | ".join(entries) + " |")
  return rows


def render_table() -> str:
  """The "What is supported" tables: a summary, then every cell."""
  cells = CELLS + REFUSED_CELLS
  outcomes = [outcome(c) for c in cells]
  exact = outcomes.count("exact")
  refused = sum(o.startswith("refused") for o in outcomes)
  lines = [
      _BEGIN, "",
      f"{len(cells)} cells: {exact} exact, {refused} refused,"
      f" {len(cells) - exact - refused} failing. Entry points checked"
      " exact, by form and mesh (V: `value_and_grad`, C:"
      " `coupled_value_and_grad`, P: `plan_microbatches`; n/a: the"
      " combination means nothing):", "",
      *_summary(), "",
      "| entry point | form | mesh | parameters | batch | feature |"
      " outcome |",
      "|---|---|---|---|---|---|---|",
  ]
  for cell, result in zip(cells, outcomes):
    values = [cell[name].replace("|", "\\|") for name in DIMENSIONS]
    lines.append("| " + " | ".join(values) + f" | {result} |")
  lines += ["", _END]
  return "\n".join(lines)


def _documented() -> str:
  text = DOC.read_text()
  return text[text.index(_BEGIN):text.index(_END) + len(_END)]


def test_docs_table_is_the_one_these_cells_render():
  assert _documented() == render_table(), (
      f"docs/support_matrix.md is out of date: run {REGENERATE}")


if __name__ == "__main__":
  _text = DOC.read_text()
  DOC.write_text(_text.replace(_documented(), render_table()))
