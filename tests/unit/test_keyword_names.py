"""Keyword arguments of other libraries get our names, not Python's bare
"unexpected keyword argument"."""

import inspect

import jax.numpy as jnp
import optax
import pytest

import optax_accum as oa
from optax_accum._src import keyword_names


@pytest.mark.parametrize("name, says", [
    ("use_grad_mean", "num_tokens=n to each tx.update call"),
    ("every_k_schedule", "every_k=k"),
    ("should_skip_update_fn", "skip_nonfinite=True"),
    ("num_tokens", "belongs to each tx.update call"),
])
def test_accumulate_names_other_libraries_keywords(name, says):
  with pytest.raises(TypeError, match=f"accumulate takes no argument '{name}'"
                     ) as e:
    oa.accumulate(optax.sgd(0.1), 4, **{name: True})
  assert says in str(e.value)


def test_value_and_grad_names_num_tokens():
  with pytest.raises(TypeError, match="write num_tokens_fn=lambda mb"):
    oa.value_and_grad(lambda p, b: jnp.sum(p), num_microbatches=2,
                      num_tokens=3)


def test_a_slip_gets_the_closest_name_and_the_list():
  with pytest.raises(TypeError, match="Did you mean 'skip_nonfinite'") as e:
    oa.accumulate(optax.sgd(0.1), 4, skip_non_finite=True)
  assert "every_k, loss_reduction" in str(e.value)


def test_own_keywords_pass_and_the_signature_is_kept():
  tx = oa.accumulate(optax.sgd(0.1), every_k=2, skip_nonfinite=True)
  assert isinstance(tx, oa.AccumulateTransformation)
  assert "every_k" in inspect.signature(oa.accumulate).parameters

  @keyword_names.takes_only_own_keywords({})
  def f(a, *, b=1):
    return a + b

  assert f(1, b=2) == 3
  with pytest.raises(TypeError, match="f takes no argument 'c'"):
    f(1, c=2)
