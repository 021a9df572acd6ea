"""One of the JAX processes that test_multiprocess.py starts (not a test).

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Gives itself LOCAL_DEVICES simulated CPU devices, joins the other processes
on 127.0.0.1:PORT over gloo, and runs two problems under ``jax.jit`` on
meshes of every process's CPU devices (Explicit axes: the typed form):

* a linear model, the batch sharded over a ``data`` axis of all devices,
  ``oa.value_and_grad(..., axis_name="data")``;
* the cookbook-style decoder of ``zoo/typed_model.py`` on a ``data`` x
  ``tensor`` mesh, its tensor-parallel weights spanning the processes,
  ``oa.value_and_grad`` without ``axis_name``;
* ZeRO-1 and ZeRO-2 (docs/zero.md): a 2-layer tanh MLP's adamw updates with
  the state sharded over the 8-device ``data`` axis by ``oa.zero_specs``,
  so that each shard's reduce-scatter and the updates' all-gather cross the
  processes.

It writes the losses, the gradients, the ZeRO parameters and state shards,
and the steps' collectives to OUT_JSON.
Importing this module only defines the problems, for the test's
single-process reference.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import helpers

LOCAL_DEVICES = 4  # per process.
TYPED_BATCH = 16  # sequences of the decoder problem.
NUM_MICROBATCHES = 2
BATCH, SEQ, DIM = 16, 4, 8
ZERO_HIDDEN, ZERO_UPDATES = 16, 2
ZERO_SYNCS = ("once", "every_microbatch")  # ZeRO-1, ZeRO-2.


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


def zero_params():
  """The ZeRO problem's MLP, in numpy.

  ``w1`` (8 rows) and ``w2`` (16) shard over 8 devices; ``odd`` (3 values)
  does not divide by 8, so ``oa.zero_specs`` leaves it whole on every device.
  """
  rng = np.random.default_rng(2)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  return {"w1": normal(DIM, ZERO_HIDDEN) * 0.3,
          "w2": normal(ZERO_HIDDEN) * 0.3, "odd": normal(3)}


def zero_loss(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  pred = hidden @ params["w2"] + jnp.sum(params["odd"])
  return helpers.safe_mean(batch["mask"] * (pred - batch["y"]) ** 2, batch)


def zero_batches():
  """One batch per update, with uneven token counts.

  In the first, the odd rows have no token: each device's 2 rows split into
  2 micro-batches, so micro-batch 1 is empty on every device (n_1 = 0).
  """
  rng = np.random.default_rng(3)
  out = []
  for u in range(ZERO_UPDATES):
    lengths = rng.integers(0, SEQ + 1, size=BATCH)
    if u == 0:
      lengths[1::2] = 0
    out.append(helpers.padded_batch(rng, lengths, SEQ, DIM))
  return out


def zero_optimizer():
  return helpers.clipped_adamw(ZERO_UPDATES)


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
    compiled = fn.lower(params_, batch).compile()
  local = lambda x: np.asarray(x.addressable_data(0)).tolist()
  result = {
      "process_index": jax.process_index(),
      "device_count": jax.device_count(),
      "local_device_count": jax.local_device_count(),
      "loss": local(loss),
      "grads": jax.tree.map(local, grads),
      "reductions": _reductions(compiled, mesh, ("data",)),
  }
  result["typed"] = _typed_problem(global_array)
  result["zero"] = {sync: _zero_problem(mesh, global_array, sync)
                    for sync in ZERO_SYNCS}
  with open(out, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


def _reductions(compiled, mesh, data_axes):
  """``[looped, bytes]`` of each reduction over the data axes."""
  from optax_accum._src.compiled import hlo  # pylint: disable=g-import-not-at-top
  return [[c.looped, c.nbytes] for c in hlo.collectives(compiled, mesh)
          if c.collective in ("all-reduce", "reduce-scatter")
          and set(c.axes) & set(data_axes)]


def typed_config():
  from zoo import typed_model  # pylint: disable=g-import-not-at-top
  return typed_model.Config(batch_axes=("data",), tensor="tensor")


def _typed_problem(global_array):
  """The decoder on data x tensor: loss, whole gradient, reductions."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import optax_accum as oa  # pylint: disable=g-import-not-at-top
  from zoo import typed_model as tm  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "tensor"))
  cfg = typed_config()
  with jax.set_mesh(mesh):
    params_ = jax.tree.map(
        lambda x, spec: jax.make_array_from_callback(
            x.shape, jax.NamedSharding(mesh, spec),
            lambda index: np.asarray(x)[index]),
        tm.init(tm.Config()), tm.specs(cfg))
    batch = jax.tree.map(
        lambda x: jax.make_array_from_callback(
            x.shape, jax.NamedSharding(mesh, P("data")),
            lambda index: np.asarray(x)[index]),
        tm.batch(tm.Config(), TYPED_BATCH))
    fn = jax.jit(oa.value_and_grad(
        tm.loss_fn(cfg), num_microbatches=NUM_MICROBATCHES,
        num_tokens_fn=tm.num_tokens))
    loss, grads = fn(params_, batch)
    compiled = fn.lower(params_, batch).compile()
    whole = multihost_utils.process_allgather(grads, tiled=True)
  return {
      "loss": float(np.asarray(loss.addressable_data(0))),
      # The leaves in tree order (JSON has no pytrees).
      "grads": [np.asarray(x).tolist() for x in jax.tree.leaves(whole)],
      "reductions": _reductions(compiled, mesh, ("data",)),
  }


def _zero_problem(mesh, global_array, gradient_sync):
  """ZERO_UPDATES adamw updates on shards: the results, shards, collectives."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import optax_accum as oa  # pylint: disable=g-import-not-at-top
  from optax_accum._src.compiled import hlo  # pylint: disable=g-import-not-at-top

  opt = zero_optimizer()
  with jax.set_mesh(mesh):
    params_ = jax.tree.map(lambda x: global_array(x, P()), zero_params())
    batches = [jax.tree.map(lambda x: global_array(x, P("data")), b)
               for b in zero_batches()]
    specs = oa.zero_specs(params_, "data")
    opt_state = jax.jit(
        lambda p: opt.init(jax.sharding.reshard(p, specs)))(params_)
    grad_fn = oa.value_and_grad(
        zero_loss, num_microbatches=NUM_MICROBATCHES, num_tokens_fn=num_tokens,
        param_specs=specs, gradient_sync=gradient_sync)

    @jax.jit
    def step(params, opt_state, batch):
      _, grads = grad_fn(params, batch)  # in the shards of specs.
      updates, opt_state = opt.update(
          grads, opt_state, jax.sharding.reshard(params, specs))
      updates = jax.tree.map(  # gathered back to the parameters' layout.
          lambda u, p: jax.sharding.reshard(u, jax.typeof(p).sharding.spec),
          updates, params)
      return optax.apply_updates(params, updates), opt_state, grads

    compiled = step.lower(params_, opt_state, batches[0]).compile()
    grads = []
    for batch in batches:
      params_, opt_state, g = compiled(params_, opt_state, batch)
      grads.append(g)
    mu = opt_state[1][0].mu
    # adamw is blind to a gradient's scale, and clipping rescales it: the
    # gradients themselves and adamw's mu (of the clipped ones) show it.
    whole = multihost_utils.process_allgather(
        {"params": params_, "grads": grads, "mu": mu}, tiled=True)
  as_lists = lambda tree: jax.tree.map(lambda x: np.asarray(x).tolist(), tree)
  return {
      **as_lists(whole),
      "param_specs": {name: list(jax.typeof(x).sharding.spec)
                      for name, x in params_.items()},
      # What each of this process's devices holds of adamw's first moment.
      "mu_shard_shapes": {
          name: [list(s.data.shape) for s in x.addressable_shards]
          for name, x in mu.items()},
      # [collective, looped, bytes] of each, scalars (the loss, the token
      # count, the clipping norm) left out.
      "collectives": [[c.collective, c.looped, c.nbytes]
                      for c in hlo.collectives(compiled, mesh)
                      if not c.scalar],
  }


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
