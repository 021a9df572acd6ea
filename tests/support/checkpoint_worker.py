"""One of the JAX processes of test_multiprocess_checkpoint.py (not a test).

Usage: python checkpoint_worker.py MODE PROCESS_ID NUM_PROCESSES PORT DIR

Gives itself LOCAL_DEVICES simulated CPU devices, joins the other processes
on 127.0.0.1:PORT over gloo, and trains ZeRO-1 with one jit call per
micro-batch (docs/zero.md: ``oa.accumulate(..., shard_optimizer="data")`` on
``gradient_sync="deferred"`` gradients) on an 8-device ``data`` axis that
spans the processes. MODE ``save`` stops mid-cycle, saves the parameters
and ``oa.checkpointable_state(state)`` with orbax under DIR, then trains on
without stopping; MODE ``restore`` starts afresh, restores them as the docs
say (the target from shapes only) and trains the same micro-batches, and
beside them from the restored state reduced (``oa.reduced_state``: the
negative control). Each writes the final parameters and state (under
``'run'``; the control's under ``'reduced'``), gathered whole, to
DIR/MODE_PROCESS_ID.npz.
"""

import sys

import jax
import numpy as np

LOCAL_DEVICES = 4  # per process.
EVERY_K, MICRO_STEPS, SAVE_AFTER = 3, 6, 4  # saved one micro-step in.
ROWS, DIM, HIDDEN = 16, 8, 16


def _problem():
  """The MLP's parameters and the micro-batches, in numpy."""
  rng = np.random.default_rng(5)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  params = {"w1": normal(DIM, HIDDEN) * 0.3, "w2": normal(HIDDEN) * 0.3,
            "odd": normal(3)}
  batches = [{"x": normal(ROWS, DIM), "y": normal(ROWS),
              "mask": (rng.random(ROWS) < 0.6).astype(np.float32)}
             for _ in range(MICRO_STEPS)]
  return params, batches


def main(mode: str, process_id: int, num_processes: int, port: int,
         folder: str) -> None:
  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P
  import orbax.checkpoint as ocp

  import helpers
  import optax_accum as oa

  jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
      process_id=process_id, initialization_timeout=30)
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(AxisType.Explicit,))
  tx = oa.accumulate(helpers.clipped_adamw(2), EVERY_K,
                     shard_optimizer="data")
  micro_step = helpers.deferred_micro_step(helpers.zero_mlp_loss, tx)

  def global_array(value, spec):
    return jax.make_array_from_callback(
        value.shape, jax.NamedSharding(mesh, spec), lambda index: value[index])

  numpy_params, numpy_batches = _problem()
  path = f"{folder}/checkpoint"
  with jax.set_mesh(mesh):
    params = jax.tree.map(lambda x: global_array(x, P()), numpy_params)
    batches = [jax.tree.map(lambda x: global_array(x, P("data")), b)
               for b in numpy_batches]
    fresh = jax.jit(tx.init)(params)
    reduced = None
    if mode == "save":
      state = fresh
      for batch in batches[:SAVE_AFTER]:
        params, state = micro_step(params, state, batch)
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, (params, oa.checkpointable_state(state)))
        checkpointer.wait_until_finished()
    else:  # docs/zero.md's restore: shapes only, then the slots back.
      carried = jax.eval_shape(micro_step, params, fresh, batches[0])
      with ocp.StandardCheckpointer() as checkpointer:
        params, saved = checkpointer.restore(
            path, oa.checkpointable_state(carried))
      state = oa.restored_state(saved, fresh)
      # The negative control: the partial sums reduced at the save too.
      reduced = params, jax.jit(oa.reduced_state)(state)
    for batch in batches[SAVE_AFTER:]:
      params, state = micro_step(params, state, batch)
      if reduced is not None:
        reduced = micro_step(*reduced, batch)
    final = multihost_utils.process_allgather(oa.checkpointable_state(
        {"run": (params, state), "reduced": reduced}), tiled=True)
  leaves = jax.tree_util.tree_leaves_with_path(final)
  np.savez(f"{folder}/{mode}_{process_id}.npz",
           **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
       sys.argv[5])
