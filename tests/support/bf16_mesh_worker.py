"""One bfloat16 case on a data x model mesh, in its own process (not a test).

Usage: python bf16_mesh_worker.py ENTRY FORM LAYOUT

XLA used to abort the whole process (``hlo_instruction.cc: Invalid binary
instruction opcode copy``) compiling a bfloat16 sum over the data axis in a
shard_map that leaves the model axis automatic, so test_coupled.py runs each
case here and reads the exit status. ENTRY is ``coupled`` (an InfoNCE loss
by gradient caching) or ``value_and_grad`` (a bfloat16 accumulator); FORM is
``auto`` or ``explicit`` (jit under ``jax.set_mesh``) or ``shard_map`` (the
user's shard_map over ``data``); LAYOUT is ``tp`` (parameters split over
``model``) or ``fsdp`` (split over ``data``). The result is checked against
one device's and ``matches one device`` printed.
"""

import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np

import optax_accum as oa

jax.config.update("jax_num_cpu_devices", 8)

BATCH, DIM, EMB = 32, 8, 4
SPECS = {
    # Rows of the weights over "model": Explicit axes type x @ w without
    # an out_sharding only when one side of the contraction is sharded.
    "tp": {"wa": P("model", None), "wb": P("model", None), "v": P("model")},
    "fsdp": {"wa": P("data", None), "wb": P("data", "model"), "v": P()},
}


def _problem():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s) / 2, jnp.bfloat16)
  params = {"wa": f(DIM, EMB), "wb": f(DIM, EMB), "v": f(EMB)}
  x = rng.normal(size=(BATCH, DIM))
  batch = {"a": jnp.asarray(x, jnp.bfloat16),
           "b": jnp.asarray(x + 0.3 * rng.normal(size=x.shape), jnp.bfloat16),
           "y": f(BATCH)}
  return params, batch


def encode(params, mb):
  return {"a": jnp.tanh(mb["a"] @ params["wa"]),
          "b": jnp.tanh(mb["b"] @ params["wb"])}


def info_nce(params, reps, batch):
  del batch
  logits = reps["a"] @ reps["b"].T + jnp.sum(params["v"])
  labels = jnp.arange(logits.shape[0])
  return -jax.nn.log_softmax(logits, axis=1)[labels, labels].mean()


def regression(params, mb):
  pred = encode(params, mb)["a"] @ params["v"]
  return jnp.mean((pred - mb["y"]) ** 2)


def _fn(entry, axis_name, param_specs=None):
  if entry == "coupled":
    return oa.coupled_value_and_grad(encode, info_nce, num_microbatches=2,
                                     axis_name=axis_name,
                                     param_specs=param_specs)
  return oa.value_and_grad(regression, num_microbatches=2,
                           axis_name=axis_name, param_specs=param_specs,
                           accumulator_dtype=jnp.bfloat16)


def main(entry, form, layout):
  params, batch = _problem()
  expected = jax.jit(_fn(entry, None))(params, batch)
  axis_type = AxisType.Explicit if form == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  fn = _fn(entry, "data")
  if form == "shard_map":  # the model axis stays automatic.
    specs = {k: P(*[a if a == "data" else None for a in s])
             for k, s in SPECS[layout].items()}
    fn = jax.shard_map(_fn(entry, "data", specs), in_specs=(specs, P("data")),
                       out_specs=(P(), specs), axis_names={"data"})
  with jax.set_mesh(mesh):
    placed = jax.device_put(params, SPECS[layout])
    loss, grads = jax.jit(fn)(placed, jax.device_put(batch, P("data")))
  np.testing.assert_allclose(np.float32(loss), np.float32(expected[0]),
                             rtol=2e-2)
  for k in params:
    np.testing.assert_allclose(np.float32(grads[k]),
                               np.float32(expected[1][k]), rtol=5e-2,
                               atol=2e-2, err_msg=k)
  print("matches one device")


if __name__ == "__main__":
  main(*sys.argv[1:])
