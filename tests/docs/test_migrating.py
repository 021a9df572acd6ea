"""docs/migrating.md: its recipes run, and say what they print.

- The usual ``MultiSteps`` loop, moved to ``oa.accumulate`` with
  ``num_tokens``, takes the full batch's step (``MultiSteps`` the mean of the
  micro-batches' means: the negative control).
- A linen ``TrainState`` whose ``apply_gradients`` passes ``num_tokens``
  takes the same step.
- A ``MultiStepsState`` converted by ``from_multi_steps`` at any micro-step
  of a run goes on as the unconverted ``MultiSteps`` run does, the update
  count included (an ``every_k`` schedule reads it); the old recipe, which
  restarted the count, does not.
"""

import contextlib
import io

import pytest

import helpers
import optax_accum as oa

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run():
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    namespace = helpers.run_markdown_snippets("docs/migrating.md",
                                              min_blocks=4)
  return namespace, printed.getvalue().splitlines()


@pytest.fixture
def page(run):
  return run[0]


def test_the_page_prints_what_its_comments_say(run):
  assert run[1] == ["True 1 0", "True True", "True 4 1", "5 5 True"]


def test_the_usual_loop_takes_the_full_batchs_step(page):
  helpers.assert_trees_close(page["runs"]["after"], page["full_step"],
                             rtol=1e-5, atol=1e-6)
  assert not helpers.trees_close(page["runs"]["before"], page["full_step"],
                                 rtol=1e-3, atol=1e-4)
  helpers.assert_trees_close(page["flax_state"].params, page["runs"]["after"],
                             rtol=1e-5, atol=1e-6)


def _run(step, params, state, microbatches):
  for mb in microbatches:
    params, state, _ = step(params, state, mb)
  return params, state


def test_a_checkpoint_converted_at_any_micro_step_continues_the_run(page):
  multi_steps, tx = page["multi_steps"], page["tx"]
  before, after = page["before"], page["after"]
  mbs = page["microbatches"]
  stream = (mbs * 4)[:13]  # 2-step cycles for 3 updates, then 3-step ones.
  params0 = page["params0"]
  ref_params, ref_state = _run(before, params0, multi_steps.init(params0),
                               stream)
  assert int(ref_state.gradient_step) == 5
  for cut in range(len(stream)):
    params, old = _run(before, params0, multi_steps.init(params0),
                       stream[:cut])
    state = page["from_multi_steps"](old, tx, params)
    assert int(state.count) == int(old.gradient_step), cut
    assert int(state.micro_step) == int(old.mini_step), cut
    assert bool(oa.has_updated(state)) == bool(
        multi_steps.has_updated(old)), cut
    params, state = _run(after, params, state, stream[cut:])
    helpers.assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
    assert int(state.count) == int(ref_state.gradient_step), cut
    assert int(state.micro_step) == int(ref_state.mini_step), cut
    helpers.assert_trees_close(state.inner_state, ref_state.inner_opt_state,
                               rtol=1e-5, atol=1e-6)


def test_the_old_recipe_restarted_the_update_count(page):
  """The negative control: ``tx.init(params)._replace(inner_state=...)``,
  at a cycle boundary, restarts ``count``: the schedule, which reads it, then
  ends the wrong cycles."""
  multi_steps, tx = page["multi_steps"], page["tx"]
  before, after = page["before"], page["after"]
  stream = (page["microbatches"] * 4)[:13]
  params0 = page["params0"]
  ref_params, ref_state = _run(before, params0, multi_steps.init(params0),
                               stream)
  params, old = _run(before, params0, multi_steps.init(params0), stream[:6])
  assert int(old.mini_step) == 0 and int(old.gradient_step) == 3
  restarted = tx.init(params)._replace(inner_state=old.inner_opt_state)
  params, state = _run(after, params, restarted, stream[6:])
  assert int(state.count) != int(ref_state.gradient_step)
  assert not helpers.trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
  assert int(page["from_multi_steps"](old, tx, params0).count) == 3
