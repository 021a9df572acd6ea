"""``sum_layout``: one interface for every form, one implementation per form.

Two seams, each chosen once: where the running sum lives (the
:class:`sum_layout.SumLayout` that ``update_call.layout_for`` picks, for
``init`` and for each call) and
what the emitting step hands back (the :class:`outputs.Output` that
``emit.output_for`` picks). Each implementation has the whole Protocol;
below the choice nothing asks which one it got; and every form's emitted
update is the single-device form's on the same global batch.
"""

import functools
import inspect
import re
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax
import pytest

import accumulate_parts
from accumulate_parts import N
import helpers
import optax_accum as oa
from optax_accum._src import names
from optax_accum._src.accumulate import emit
from optax_accum._src.accumulate import local_sums
from optax_accum._src.accumulate import outputs
from optax_accum._src.accumulate import slot_sums
from optax_accum._src.accumulate import state as state_lib
from optax_accum._src.accumulate import sum_layout
from optax_accum._src.accumulate import transform
from optax_accum._src.accumulate import typed_sums
from optax_accum._src.accumulate import update_call
from optax_accum._src.accumulate import zero_sums

LAYOUTS = (local_sums.SingleSums, local_sums.ManualSums, typed_sums.TypedSums,
           slot_sums.SlotSums, zero_sums.ZeroSums)
OUTPUTS = (outputs.Updates, outputs.UpdatesInSum, outputs.Applied)
FORM_WORDS = ("SingleSums", "ManualSums", "TypedSums", "SlotSums", "ZeroSums",
              "local_sums", "typed_sums", "slot_sums", "isinstance(layout")
OUTPUT_WORDS = ("Updates(", "UpdatesInSum", "Applied", "isinstance(output")


def _members(protocol: type[Protocol]) -> set[str]:
  names = {n for n, _ in inspect.getmembers(protocol, inspect.isfunction)
           if not n.startswith("_")}
  return names | set(protocol.__annotations__)


def _missing(cls: type, protocol: type[Protocol]) -> list[str]:
  """The Protocol's members ``cls`` lacks or takes other parameters for."""
  missing = []
  for name in sorted(_members(protocol)):
    if not hasattr(cls, name):
      missing.append(name)
      continue
    want = getattr(protocol, name, None)
    if inspect.isfunction(want) and list(
        inspect.signature(getattr(cls, name)).parameters) != list(
            inspect.signature(want).parameters):
      missing.append(f"{name}()")
  return missing


@pytest.mark.parametrize("cls", LAYOUTS, ids=lambda c: c.__name__)
def test_each_sum_layout_implements_the_whole_protocol(cls):
  assert _missing(cls, sum_layout.SumLayout) == []


@pytest.mark.parametrize("cls", OUTPUTS, ids=lambda c: c.__name__)
def test_each_output_implements_the_whole_protocol(cls):
  assert _missing(cls, outputs.Output) == []


def test_the_conformance_check_sees_a_missing_or_renamed_member():
  """Negative control: a layout without ``check_emit`` and with ``add``'s
  parameters renamed fails the check that the real ones pass."""

  class Partial(NamedTuple):
    local: bool = True

    def init(self, inner, params, settings):
      del inner, params, settings

    def add(self, grads, state, params, settings):
      del grads, state, params, settings

    def reduced(self, cycle, rules):
      del rules
      return cycle

  assert _missing(Partial, sum_layout.SumLayout) == ["add()", "check_emit"]
  assert _members(sum_layout.SumLayout) == {"local", "init", "add",
                                            "reduced", "check_emit"}


def test_only_the_single_form_reads_its_sums_as_they_are():
  """``local`` (the emitted updates may live in the sum's buffer) holds for
  the form whose ``reduced`` is the identity, and for no other."""
  layouts = [local_sums.SingleSums(), local_sums.ManualSums("data"),
             typed_sums.TypedSums(), slot_sums.SlotSums("data"),
             zero_sums.ZeroSums(("data",), names.ONCE,
                                local_sums.SingleSums())]
  assert [layout.local for layout in layouts] == [True] + [False] * 4
  cycle = sum_layout.Cycle({"w": jnp.ones(2)}, jnp.float32(3.0), None,
                           None)
  assert local_sums.SingleSums().reduced(cycle, None) is cycle


def _code(module) -> str:
  """A module's source without its import lines."""
  return re.sub(r"(?m)^(from|import) .*$", "", inspect.getsource(module))


def _source_below_the_choice() -> dict[str, str]:
  """The code that runs below ``layout_for``: the step of one call
  without ``layout_for`` itself, the emitting step, its outputs, the first
  state and the factory (their imports left out)."""
  decider = inspect.getsource(update_call.layout_for)
  step = _code(update_call)
  assert decider in step
  return {"update_call": step.replace(decider, ""), "emit": _code(emit),
          "outputs": _code(outputs), "transform": _code(transform),
          "state": _code(state_lib)}


def test_below_layout_for_nothing_asks_which_form_it_is_in():
  for module, source in _source_below_the_choice().items():
    for word in FORM_WORDS:
      assert word not in source, (module, word)
  # The form is decided once a call: one call of layout_for in the step,
  # and one in init, which lays the state out by the layout it picks.
  assert inspect.getsource(update_call).count("layout_for(") == 2
  assert _code(transform).count("layout_for(") == 1
  assert "layout_for" not in _code(emit) + _code(state_lib)


def test_the_scan_for_form_names_finds_them_where_the_form_is_decided():
  """Negative control: the words the scan looks for are in the decider."""
  decider = inspect.getsource(update_call.layout_for)
  assert [w for w in FORM_WORDS[:5] if w in decider] == [
      "SingleSums", "ManualSums", "TypedSums", "SlotSums", "ZeroSums"]


def test_below_output_for_nothing_asks_which_output_it_has():
  """The emit decision and the step read the Output through its Protocol;
  the words scanned for are in the chooser (the negative control)."""
  below = [inspect.getsource(emit.decide), inspect.getsource(emit._run_inner),
           inspect.getsource(update_call.Step)]
  for source in below:
    for word in OUTPUT_WORDS:
      assert word not in source, word
  chooser = inspect.getsource(emit.output_for)
  assert all(w in chooser for w in OUTPUT_WORDS[:3])


# Every form against the single-device one: one cycle of K micro-steps,
# uneven token counts, the first micro-step without any token. One jit call
# per micro-step: the forms are kept across calls.

K = 3  # micro-steps per update.
ROWS, SEQ, DIM, HIDDEN = 2 * N, 3, 2, N  # HIDDEN = N: ZeRO shards each leaf.


@functools.cache
def _micro_batches():
  """K micro-batches; in the first no row has a token, in the second the
  first device's rows have none. NumPy arrays: an array made under one
  form's mesh would carry it into the next form."""
  batches = helpers.uneven_micro_batches(K + 1, 0, ROWS, SEQ, DIM, N)[1:]
  batches[0]["mask"] = jnp.zeros_like(batches[0]["mask"])
  return jax.device_get(batches)


def _tx(**kwargs):
  return oa.accumulate(optax.adam(0.1), K, **kwargs)


class CycleEnd(NamedTuple):
  """What a form's cycle leaves: the updates and what adam kept of them."""

  updates: Any
  adam: Any  # scale-sensitive: adam's first update is about -lr * sign(g).
  tokens_seen: jax.Array


def _cycle(step, params, state, batches) -> CycleEnd:
  for batch in batches:
    updates, state = step(params, state, batch)
  assert bool(oa.has_updated(state)) and int(state.micro_step) == 0
  return jax.device_get(CycleEnd(updates, state.inner_state[0],
                                 oa.tokens_seen(state)))


def _single_device(tx, count=helpers.num_tokens) -> CycleEnd:
  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(helpers.mlp_mean_loss)(params, batch)
    return tx.update(grads, state, params, num_tokens=count(batch))

  params = helpers.mlp_params(DIM, HIDDEN, seed=1)
  return _cycle(step, params, tx.init(params), _micro_batches())


@functools.cache
def _single() -> CycleEnd:
  return _single_device(_tx())


def _manual() -> CycleEnd:
  """Inside jax.shard_map with axis_name: each device's own tokens."""
  tx = _tx(axis_name="data")

  def step(params, state, batch):
    grads = jax.grad(helpers.mlp_mean_loss)(
        oa.device_local(params, "data"), batch)
    return tx.update(grads, state, params,
                     num_tokens=helpers.num_tokens(batch))

  batches = _micro_batches()
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = helpers.mlp_params(DIM, HIDDEN, seed=1)
    state = tx.init(params)  # one slot per device.
    specs = oa.state_partition_specs(state, "data")
    step = jax.jit(jax.shard_map(step, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    return _cycle(step, params, state, jax.device_put(batches, P("data")))


def _deferred(tx, axis_name=None) -> CycleEnd:
  """Under jit, gradients typed unreduced over "data"; global counts."""
  grad_fn = oa.value_and_grad(
      helpers.mlp_mean_loss, num_microbatches=1,
      num_tokens_fn=helpers.num_tokens, axis_name=axis_name,
      gradient_sync="deferred")

  @jax.jit
  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    return tx.update(grads, state, params,
                     num_tokens=helpers.num_tokens(batch))

  batches = _micro_batches()
  with jax.set_mesh(accumulate_parts.explicit_mesh()):
    params = jax.device_put(helpers.mlp_params(DIM, HIDDEN, seed=1), P())
    return _cycle(step, params, jax.jit(tx.init)(params),
                  jax.device_put(batches, P("data")))


FORMS = {
    "manual": _manual,
    "typed": lambda: _deferred(_tx()),
    "slots": lambda: _deferred(_tx(axis_name="data"), axis_name="data"),
    "zero1": lambda: _deferred(_tx(shard_optimizer="data")),
    "zero2": lambda: _deferred(_tx(shard_optimizer="data",
                                   gradient_sync="every_microbatch")),
}


@pytest.mark.parametrize("form", [
    pytest.param(form, marks=() if form == "manual" else (
        accumulate_parts.needs_unreduced_types,)) for form in sorted(FORMS)])
def test_every_form_emits_the_single_device_update(form):
  helpers.assert_trees_close(FORMS[form](), _single(), rtol=1e-5, atol=1e-7)


def test_the_comparison_tells_a_mean_of_micro_batch_means():
  """Negative control: the same cycle weighted per micro-batch, not per
  token (the empty micro-step counted as one), is told apart by adam's
  moments, though its updates (about -lr * sign(g)) may agree."""
  naive = _single_device(_tx(), count=lambda batch: 1)
  assert not helpers.trees_close(naive.adam.mu, _single().adam.mu,
                                 rtol=1e-3)
  assert float(naive.tokens_seen) == K != float(_single().tokens_seen)
