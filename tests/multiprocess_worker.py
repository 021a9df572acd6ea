"""One of the JAX processes that test_multiprocess.py starts (not a test).

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Gives itself LOCAL_DEVICES simulated CPU devices, joins the other processes
on 127.0.0.1:PORT over gloo, shards a global batch
over the ``data`` axis of a mesh of every process's CPU devices, runs
``oa.value_and_grad(..., axis_name="data")`` under ``jax.jit`` and writes the
loss, the gradient and the step's collective counts to OUT_JSON. Importing
this module only defines the problem, for the test's single-process
reference.
"""

import json
import sys

import jax
import numpy as np

import helpers

LOCAL_DEVICES = 2  # per process.
NUM_MICROBATCHES = 2
BATCH, SEQ, DIM = 16, 4, 8


def data():
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, SEQ + 1, size=BATCH)  # uneven token counts.
  return helpers.padded_batch(rng, lengths, SEQ, DIM)


def params():
  """The parameters of :func:`helpers.linear_token_losses`, in numpy.

  Not ``helpers.linear_params``: numpy's float32 ``linspace`` differs from
  jax's in the last bits, and these are the values this test has always used.
  """
  return {
      "w": np.linspace(-1.0, 1.0, DIM, dtype=np.float32),
      "b": np.asarray(0.3, np.float32),
  }


def mean_loss(params, batch):
  return helpers.safe_mean(
      helpers.linear_token_losses(params, batch), batch
  )


num_tokens = helpers.num_tokens


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P

  import optax_accum as oa

  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}",
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=30,
  )
  mesh = jax.make_mesh((jax.device_count(),), ("data",))

  def global_array(value, spec):
    """Each process supplies only the rows that its own devices hold."""
    return jax.make_array_from_callback(
        value.shape, jax.NamedSharding(mesh, spec), lambda index: value[index]
    )

  with jax.set_mesh(mesh):
    params_ = jax.tree.map(lambda x: global_array(x, P()), params())
    batch = jax.tree.map(lambda x: global_array(x, P("data")), data())
    fn = jax.jit(oa.value_and_grad(
        mean_loss, num_microbatches=NUM_MICROBATCHES, num_tokens_fn=num_tokens,
        axis_name="data",
    ))
    loss, grads = fn(params_, batch)
    counts = oa.count_collectives(fn.lower(params_, batch).compile())
  local = lambda x: np.asarray(x.addressable_data(0)).tolist()
  with open(out, "w") as f:
    json.dump({
        "process_index": jax.process_index(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "loss": local(loss),
        "grads": jax.tree.map(local, grads),
        "in_loop": counts.in_loop,
        "total": counts.total,
    }, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
