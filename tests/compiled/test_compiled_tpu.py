"""SPEC 11 on TPU v5e: programs compiled for 8 compile-only chips, read.

Needs libtpu (``pip install 'optax-accum[tpu]'``); skipped, saying so,
without it. Nothing runs: each program is lowered from abstract inputs
sharded over the devices of ``v5e:2x4`` and compiled by XLA's TPU compiler,
then read (``memory_analysis()``, the HLO). The model is the cookbook-style
decoder of ``zoo/typed_model.py`` at a small size.
"""

import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import optax
import pytest

import optax_accum as oa
from optax_accum._src.compiled import hlo
from zoo import compile_only as co
from zoo import peers
from zoo import typed_model as tm

pytestmark = [pytest.mark.skipif(co.missing_tpu() is not None,
                                 reason=co.missing_tpu() or ""),
              pytest.mark.slow]

BATCH = 64
K = 4
DATA_TENSOR = ((4, 2), ("data", "tensor"))
FSDP = ((8,), ("fsdp",))


def _cfg(names, **sizes):
  model = {"batch_axes": (names[0],)}
  model["tensor" if "tensor" in names else "fsdp"] = names[-1]
  if names == ("fsdp",):
    model = {"batch_axes": ("fsdp",), "fsdp": "fsdp"}
  return tm.Config(**{**dict(vocab=512, seq=128, dim=128, heads=4, ffn=512,
                             layers=2), **sizes}, **model)


def _inputs(mesh, cfg, batch=BATCH):
  params = co.abstract(jax.eval_shape(lambda: tm.init(cfg)), mesh,
                       tm.specs(cfg))
  data = jax.eval_shape(lambda: tm.batch(cfg, batch))
  data = co.abstract(data, mesh, jax.tree.map(lambda _: P(cfg.batch_axes),
                                              data))
  return params, data


def _setup(layout, axis_type=AxisType.Explicit, **sizes):
  shape, names = layout
  mesh = co.mesh(co.tpu_devices(), shape, names, axis_type)
  cfg = _cfg(names, **sizes)
  return mesh, cfg, _inputs(mesh, cfg)


def _compile(mesh, fn, *args):
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the fallback leaf.
    return jax.jit(fn).lower(*args).compile()


def _typed(cfg, k=K, **kwargs):
  return oa.value_and_grad(tm.loss_fn(cfg), num_microbatches=k,
                           num_tokens_fn=tm.num_tokens, **kwargs)


def _pos_bytes(cfg):
  return cfg.seq * cfg.dim * 4  # the fallback leaf, params['pos'].


def test_count_collectives_reads_the_compile_only_executable():
  """As its text, by mesh axes too (it has no local devices)."""
  mesh, cfg, args = _setup(DATA_TENSOR)
  compiled = _compile(mesh, _typed(cfg), *args)
  assert "TPU" in str(co.tpu_devices()[0].device_kind)
  text = compiled.as_text()
  for kwargs in ({}, {"include_scalars": False}):
    counts = oa.count_collectives(compiled, mesh=mesh, **kwargs)
    assert counts == oa.count_collectives(text, mesh=mesh, **kwargs)
    assert counts.by_axes  # every collective placed on mesh axes.


def test_a_compile_only_program_has_its_arguments_device_order():
  """Logical ids are the devices of the arguments' mesh, in its order."""
  devices = co.tpu_devices()[::-1]  # not in id order.
  mesh = co.mesh(devices, (4, 2), ("data", "tensor"))
  x = co.abstract(jax.ShapeDtypeStruct((8, 128), jnp.float32), mesh,
                  P("data", "tensor"))
  compiled = _compile(mesh, lambda x: x.sum(0), x)
  assert hlo._device_assignment(compiled) == list(devices)
  counts = oa.count_collectives(compiled, mesh=mesh).by_axes
  assert list(counts) == [("data",)], counts


def test_typed_form_reduces_no_gradient_over_data_in_the_loop():
  """SPEC 5: data x tensor; at most the fallback leaf in the loop."""
  mesh, cfg, args = _setup(DATA_TENSOR)
  compiled = _compile(mesh, _typed(cfg), *args)
  reductions = co.data_reductions(compiled, mesh, cfg.batch_axes)
  in_loop = [c for c in reductions if c.looped]
  assert sum(c.nbytes for c in in_loop) <= _pos_bytes(cfg), in_loop
  assert [c for c in reductions if not c.looped]  # the gradient, once.


def test_check_train_step_passes_the_typed_step():
  """On data x tensor: k loops (read off the loop's condition, where XLA's
  TPU compiler writes no known_trip_count), each leaf reduced once after."""
  mesh, cfg, args = _setup(DATA_TENSOR)
  compiled = _compile(mesh, _typed(cfg), *args)
  found = oa.check_train_step(compiled, num_microbatches=K,
                              data_axes=cfg.batch_axes, params=args[0])
  assert found.trip_counts == (K,) and found.in_loop == {}
  assert found.reduced_elements == found.gradient_elements
  with pytest.raises(AssertionError, match=f"runs {K} times, expected 8"):
    oa.check_train_step(compiled, num_microbatches=8)


def test_peak_memory_falls_with_the_number_of_microbatches():
  """With activations well over what XLA keeps outside HBM; the peak per
  chip (peak_memory_in_bytes: each buffer once), as XLA spends it."""
  shape, names = DATA_TENSOR
  mesh = co.mesh(co.tpu_devices(), shape, names)
  cfg = _cfg(names, vocab=32768, seq=256, layers=1)
  args = _inputs(mesh, cfg, batch=128)
  peak = [_compile(mesh, _typed(cfg, k), *args).memory_analysis()
          .peak_memory_in_bytes for k in (1, 2, 4)]
  assert peak[0] > peak[1] > peak[2], peak


def test_deferred_micro_step_reduces_the_gradient_only_when_it_emits():
  """SPEC 8: per call only scalars; the gradient in the emitting branch."""
  shape, names = ((8,), ("data",))
  mesh = co.mesh(co.tpu_devices(), shape, names)
  cfg = tm.Config(vocab=512, seq=128, dim=128, heads=4, ffn=512, layers=1,
                  batch_axes=("data",), pos_broadcast=True)  # no fallback.
  params, batch = _inputs(mesh, cfg, batch=16)
  tx = oa.accumulate(optax.sgd(0.1), every_k=K, axis_name="data")
  grad_fn = _typed(cfg, k=1, axis_name="data", gradient_sync="deferred")

  def micro_step(params, opt_state, batch):
    _, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   num_tokens=tm.num_tokens(batch))
    return optax.apply_updates(params, updates), opt_state

  with jax.set_mesh(mesh):
    opt_state = jax.eval_shape(tx.init, params)
  compiled = _compile(mesh, micro_step, params, opt_state, batch)
  reductions = co.data_reductions(compiled, mesh, ("data",))
  assert reductions and all(c.branched for c in reductions), reductions


def test_plan_counts_a_program_over_the_chip_memory_as_not_fitting():
  """XLA's TPU compiler refuses k=1 (RESOURCE_EXHAUSTED): planned past."""
  shape, names = ((8,), ("data",))
  mesh = co.mesh(co.tpu_devices(), shape, names)
  cfg = tm.Config(vocab=32768, seq=1024, dim=128, heads=4, ffn=256,
                  layers=1, batch_axes=("data",))
  params, batch = _inputs(mesh, cfg, batch=512)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    plan = oa.plan_microbatches(
        tm.loss_fn(cfg), params, batch, memory_budget=16 * 2**30,
        candidates=(1, 4), num_tokens_fn=tm.num_tokens)
  refused, chosen = plan.table
  assert refused.memory_bytes is None and not refused.fits
  assert "refused" in str(plan.table)
  assert plan.num_microbatches == 4 and chosen.fits
  assert chosen.memory_bytes <= 16 * 2**30


def test_a_psum_scatter_of_a_partial_gradient_is_a_reduce_scatter():
  """What the FSDP fix emits: lax.psum_scatter in a full-manual shard_map.

  Each device's gradient of the whole weight, scattered over fsdp: XLA's
  TPU compiler keeps it a reduce-scatter (a quarter of a ring's all-reduce
  bytes per device on 8 chips, half on the wire), where the typed form's
  all-reduce + slice stayed an all-reduce for some leaves.
  """
  mesh = co.mesh(co.tpu_devices(), (8,), ("fsdp",))

  def partial_grad(w, x):  # one device's rows: a partial gradient of w.
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)

  f = jax.shard_map(partial_grad, mesh=mesh, in_specs=(P(), P("fsdp")),
                    out_specs=P("fsdp"), check_vma=False)  # g: per device.
  w, x = co.abstract(
      (jax.ShapeDtypeStruct((256, 128), jnp.float32),
       jax.ShapeDtypeStruct((64, 256), jnp.float32)), mesh, (P(), P("fsdp")))
  compiled = _compile(mesh, f, w, x)
  found = co.data_reductions(compiled, mesh, ("fsdp",))
  assert [(c.collective, c.nbytes) for c in found] == [
      ("reduce-scatter", 256 * 128 * 4 // 8)]


def test_fsdp_gradients_leave_the_loop_as_reduce_scatters():
  """Leaves of any rank: the 4-D 'qkv' gradient too (f32[128, 3, 4, 32],
  sharded on dim 0), which XLA's TPU compiler all-reduced whole and sliced
  until compat.psum_scatter pinned its reduce-scatter's layout."""
  mesh, cfg, args = _setup(FSDP)
  compiled = _compile(mesh, _typed(cfg), *args)
  found = co.data_reductions(compiled, mesh, cfg.batch_axes)
  assert not [c for c in found if c.looped]
  assert "reduce-scatter" in {c.collective for c in found}
  # All-reduced: only the parameters that are not sharded over fsdp.
  all_reduced = sum(c.nbytes for c in found if c.collective == "all-reduce")
  assert all_reduced <= co.replicated_bytes(args[0], "fsdp"), found


@pytest.mark.parametrize("sync", ["once", "every_microbatch"])
def test_zero_reduce_scatters_into_the_optimizer_shards(sync):
  """SPEC 12 on data x tensor: the parameters as the model lays them out,
  adamw's state sharded over data (oa.zero_specs). ZeRO-1: each leaf
  reduce-scattered once, after the loop; ZeRO-2: in the loop. Either way
  the updates come back by all-gathers, and no gradient-sized all-reduce
  over data is left but the leaves zero_specs keeps whole."""
  mesh, cfg, (params, batch) = _setup(DATA_TENSOR)
  opt = optax.adamw(1e-3)
  with jax.set_mesh(mesh):
    specs = oa.zero_specs(params, "data")
  # All-reduced by XLA's TPU compiler (libtpu for jax 0.10.2): the 1-D
  # norms, twice (a 1-D reduce-scatter has no second-minor dimension for
  # compat.psum_scatter to pin, and their updates' all-gather becomes an
  # all-reduce too); 'pos', the fallback leaf; any leaf zero_specs keeps
  # whole.
  allowed = _pos_bytes(cfg) + sum(
      p.size * p.dtype.itemsize * (2 if p.ndim == 1 else 1)
      for p, spec in zip(
          jax.tree.leaves(params),
          jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))
      if "data" not in jax.tree.leaves(tuple(spec)) or p.ndim == 1)
  zero_step = co.zero_step(
      _typed(cfg, param_specs=specs, gradient_sync=sync), opt, specs)
  step = lambda *args: zero_step(*args)[:2]  # the loss, XLA combines with.
  opt_state = co.zero_state(opt, params, mesh, specs)
  compiled = _compile(mesh, step, params, opt_state, batch)
  found = co.data_reductions(compiled, mesh, cfg.batch_axes)
  scatters = [c for c in found if c.collective == "reduce-scatter"]
  looped = [c for c in scatters if c.looped]
  assert scatters and bool(looped) == (sync == "every_microbatch"), found
  # Left after the loop, as all-reduces or as XLA's padded reduce-scatter
  # fusion (of 'pos', whose per-micro-batch reduction XLA moves out of the
  # loop): no more than the leaves above.
  after = [c for c in found if not c.looped and (
      c.collective == "all-reduce" or sync == "every_microbatch")]
  assert sum(co.reduced_bytes(c, mesh) for c in after) <= allowed, (
      allowed, found)
  gathers = [c for c in hlo.collectives(compiled, mesh)
             if c.collective == "all-gather" and "data" in c.axes
             and not c.looped]
  assert gathers


@pytest.mark.parametrize("gather", ["once", "every_microbatch"])
def test_fsdp_every_microbatch_sync_stays_in_the_loop_and_saves_memory(
    gather):
  """SPEC 11 (issue 38, item 4): XLA's TPU compiler moved each
  `sum += reduce_scatter(g)` out of the loop, compiling the policy to
  "once"'s program; an optimization barrier pins it. The sharded sum then
  holds 1/N of the gradient through the loop: a lower peak."""
  mesh, cfg, args = _setup(FSDP)
  peaks = {}
  for sync in ("once", "every_microbatch"):
    compiled = _compile(mesh, _typed(cfg, gradient_sync=sync,
                                     gather_params=gather), *args)
    found = co.data_reductions(compiled, mesh, cfg.batch_axes)
    looped = [c for c in found
              if c.collective == "reduce-scatter" and c.looped]
    assert bool(looped) == (sync == "every_microbatch"), found
    peaks[sync] = compiled.memory_analysis().peak_memory_in_bytes
  assert peaks["every_microbatch"] < peaks["once"], peaks


_WITHIN = 1.01  # SPEC 11: the typed form's peak within 1% of the scan's.
_WIDER = dict(vocab=4096, dim=256, ffn=1024)


@pytest.mark.parametrize("layout,sizes,kwargs", [
    pytest.param(DATA_TENSOR, _WIDER, {}, id="data x tensor"),
    pytest.param(((8,), ("data",)), _WIDER, {}, id="data"),
    # 444.6 against 384.1 MiB (1.157x) while the weighting where(keep, w *
    # g, 0) sat between XLA's scatter-add of the embedding gradient and the
    # add into the sum; 384.1 once an empty micro-batch borrows a kept one's
    # data (optax_accum/_src/microbatch/borrowing.py).
    pytest.param(
        ((8,), ("data",)), dict(vocab=32768, dim=512, ffn=1024, layers=1),
        {}, id="data, embedding-heavy"),
    # The plain scan gathers each weight and reduce-scatters its gradient in
    # every micro-batch: the peer of both policies "every_microbatch". 40.7
    # against 39.0 MiB (1.044x) while the loop gathered the weights itself
    # and held them whole from the forward pass to the backward one; 39.4
    # since it hands loss_fn the shards (typed_layout's shards_to_loss), and
    # XLA gathers them again in the backward pass, as in the scan.
    pytest.param(
        FSDP, _WIDER, {"gradient_sync": "every_microbatch",
                       "gather_params": "every_microbatch"},
        id="fsdp, every_microbatch"),
])
def test_typed_form_peaks_within_one_percent_of_the_plain_scan(
    layout, sizes, kwargs):
  """SPEC 11 (issue 38, item 2): against the token-weighted lax.scan of
  jax.grad a user would write (zoo/peers.py), compiled alike."""
  shape, names = layout
  mesh = co.mesh(co.tpu_devices(), shape, names)
  cfg = _cfg(names, **sizes)
  if names == ("data",):  # data parallel only: every weight replicated.
    cfg = cfg._replace(fsdp=None)
  args = _inputs(mesh, cfg)
  devices = math.prod(mesh.shape[a] for a in cfg.batch_axes)
  peaks = [_compile(mesh, fn, *args).memory_analysis().peak_memory_in_bytes
           for fn in (_typed(cfg, **kwargs), peers.token_weighted_scan(
               tm.loss_fn(cfg), K, cfg.batch_axes, devices))]
  assert peaks[0] <= _WITHIN * peaks[1], peaks


@pytest.mark.parametrize("sync,peer", [
    ("once", peers.scan_whole_sum),
    ("every_microbatch", peers.scan_scattered_sum)])
def test_fsdp_peaks_no_higher_than_its_hand_written_peer(sync, peer):
  """SPEC 11 (issue 38, item 2): with the parameters gathered once, each
  sync policy against its fair peer, the loop a user would write for it
  (zoo/peers.py: the whole gradient's sum held and reduce-scattered after
  the loop; or each micro-batch's reduce-scattered into a sharded sum, 39.6
  against 40.6 MiB here, 1533.6 against 1621.6 at 0.24B)."""
  mesh, cfg, args = _setup(FSDP, **_WIDER)
  peaks = {name: _compile(mesh, fn, *args).memory_analysis()
           .peak_memory_in_bytes for name, fn in (
               ("typed", _typed(cfg, gradient_sync=sync)),
               ("peer", peer(cfg, mesh, K)))}
  assert peaks["typed"] <= _WITHIN * peaks["peer"], peaks


@pytest.mark.parametrize("inner", ["adamw", "muon"])
def test_donated_micro_steps_emit_without_a_copy(inner):
  """SPEC 11 (issue 38, item 3; issue 49): a donated micro-step of
  oa.update_and_apply, the copy-free form, peaks no higher than
  optax.MultiSteps's (which runs the inner every micro-step): 80 against
  129 MiB here with adamw, 74 against 89 with Muon. tx.update +
  oa.apply_if_updated holds the updates in a buffer of their own (the
  conditional's operand), the documented trade-off since no state links
  the two calls: at most one parameter-sized buffer above (106 and 90)."""
  opt = optax.adamw(1e-3) if inner == "adamw" else optax.contrib.muon(1e-3)
  peaks = {kind: co.emit_peak(co.tpu_devices()[0], kind, opt)
           for kind in co.EMIT_KINDS}
  assert peaks["update_and_apply"] <= peaks["MultiSteps"], peaks
  params_bytes = 4 * 1024 * 1024 * 4  # emit_peak's 4 x f32[1024, 1024].
  # One buffer of updates (the conditional's operand), and with adamw XLA
  # schedules 10 MiB more around it: 106 against 80 MiB here, 90 against
  # 74 with Muon (3072 against 2688 MiB at 8 x f32[4096, 4096]).
  assert peaks["apply_if_updated"] <= (
      peaks["update_and_apply"] + 2 * params_bytes), peaks


def test_an_nnx_optimizer_micro_step_peaks_no_higher_than_multisteps():
  """SPEC 11 (issue 38, item 3), inside an nnx.Optimizer: optimizer.update
  (which adds the updates with optax.apply_updates, those tx.update kept in
  the sum's buffer fused into that add: 96 MiB here, 136 before; 2688 at 8
  x f32[4096, 4096], 3072 before) and oa.update_and_apply written back
  with nnx.update (80 MiB), against optax.MultiSteps in the same
  nnx.Optimizer (134 MiB; 3008)."""
  peaks = {kind: co.nnx_emit_peak(co.tpu_devices()[0], kind,
                                  optax.adamw(1e-3))
           for kind in co.NNX_EMIT_KINDS}
  assert peaks["update_and_apply"] <= peaks["MultiSteps"], peaks
  assert peaks["nnx.Optimizer.update"] <= peaks["MultiSteps"], peaks
