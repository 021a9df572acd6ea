"""A donated deferred micro-step updates its state in place (the typed form).

One jit call per micro-batch (``gradient_sync="deferred"``, ``oa.accumulate``
without ``axis_name``) pays its per-call costs ``k`` times, so a
non-emitting call must not add a pass of its own: with the parameters and
the state donated, the compiled call aliases every donated array and copies
nothing larger than a scalar (the running sum, typed unreduced, is written in
place; the conditional only reads it). ``benchmarks/bench_nnx_deferred.py``
times the same loop in an ``nnx.Optimizer``.
"""

import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import optax_accum as oa

K, ROWS, DIM, HIDDEN = 2, 16, 16, 32
_COPY = re.compile(r"= \w+\[([\d,]*)\]\S* copy\(")


def _mesh():
  return jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)


def _loss(params, batch):
  h = jnp.tanh(jnp.einsum("bd,dh->bh", batch["x"], params["w1"],
                          out_sharding=P("data", "model")))
  pred = jnp.einsum("bh,h->b", h, params["w2"], out_sharding=P("data"))
  return jnp.mean((pred - batch["y"]) ** 2)


def _non_scalar_copies(text):
  """Top-level copy instructions of arrays with more than one element."""
  return [m.group(0) for m in _COPY.finditer(text)
          if int(np.prod([int(d) for d in m.group(1).split(",") if d])) > 1]


@pytest.mark.slow
def test_donated_non_emitting_call_is_in_place():
  rng = np.random.default_rng(0)
  tx = oa.accumulate(optax.adamw(1e-2), every_k=K)
  grad_fn = oa.value_and_grad(_loss, num_microbatches=1,
                              gradient_sync="deferred", equal_weights=True)

  def step(params, state, batch):
    _, grads = grad_fn(params, batch)
    updates, state = tx.update(grads, state, params,
                               num_tokens=jnp.float32(ROWS))
    return optax.apply_updates(params, updates), state

  with jax.set_mesh(_mesh()):
    params = {
        "w1": jax.device_put(jnp.asarray(rng.normal(size=(DIM, HIDDEN)),
                                         jnp.float32), P(None, "model")),
        "w2": jax.device_put(jnp.asarray(rng.normal(size=(HIDDEN,)),
                                         jnp.float32), P("model")),
    }
    batch = jax.device_put({
        "x": jnp.asarray(rng.normal(size=(ROWS, DIM)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(ROWS,)), jnp.float32)}, P("data"))
    jitted = jax.jit(step, donate_argnums=(0, 1))
    # The first call types the running sum unreduced; from the second call
    # on (the steady state timed per micro-step) it keeps that type.
    params, state = jitted(params, tx.init(params), batch)
    assert jax.typeof(state.grad_sum["w1"]).sharding.spec.unreduced
    compiled = jitted.lower(params, state, batch).compile()
    # XLA's sizes are one device's: its shard (its partial, if unreduced).
    # A scalar may be written afresh (the emitted flag, a conditional's).
    arrays = sum(x.addressable_shards[0].data.nbytes
                 for x in jax.tree.leaves((params, state)) if x.size > 1)
  assert _non_scalar_copies(compiled.as_text()) == []
  assert compiled.memory_analysis().alias_size_in_bytes >= arrays
