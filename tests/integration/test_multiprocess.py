"""Two JAX processes on loopback agree with the single-process full batch.

Each process has 4 simulated CPU devices (``jax_num_cpu_devices``, set by the
worker itself); gloo carries the collectives between them. Under
``jax.jit`` with Explicit axes: a linear model with the batch over an
8-device ``data`` axis, and the cookbook-style decoder of ``zoo/typed_model.py``
on a 4 x 2 ``data`` x ``tensor`` mesh, both exact against one process's full
batch and reducing their gradient once, after the micro-batch loop.
"""

import json
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import helpers
import multiprocess_worker as problem
from zoo import typed_model as tm

NUM_PROCESSES = 2
TIMEOUT_S = 150
WORKER = helpers.SUPPORT / "multiprocess_worker.py"


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(tmp_path):
  """Starts the processes, waits for all, kills all on failure or timeout."""
  env = helpers.worker_env(JAX_PLATFORMS="cpu")
  port = _free_port()
  outs = [tmp_path / f"process_{i}.json" for i in range(NUM_PROCESSES)]
  logs = [open(tmp_path / f"process_{i}.log", "w")
          for i in range(NUM_PROCESSES)]
  processes = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port),
           str(outs[i])],
          env=env, stdout=logs[i], stderr=subprocess.STDOUT,
      )
      for i in range(NUM_PROCESSES)
  ]
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for process in processes:
      process.wait(timeout=max(deadline - time.monotonic(), 0.1))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
    for log in logs:
      log.close()
  failed = [
      f"process {i} exited with {p.returncode}:\n"
      + (tmp_path / f"process_{i}.log").read_text()[-3000:]
      for i, p in enumerate(processes)
      if p.returncode != 0
  ]
  assert not failed, "\n".join(failed)
  return [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """Both problems' results, one per process: the processes run once."""
  return _run_workers(tmp_path_factory.mktemp("processes"))


def test_two_processes_agree_with_the_single_process_full_batch(results):
  expected_loss, expected_grads = jax.value_and_grad(problem.mean_loss)(
      problem.params(), problem.data()
  )
  assert sorted(r["process_index"] for r in results) == [0, 1]
  for result in results:
    assert result["device_count"] == NUM_PROCESSES * problem.LOCAL_DEVICES
    assert result["local_device_count"] == problem.LOCAL_DEVICES
    np.testing.assert_allclose(result["loss"], expected_loss, rtol=1e-5)
    helpers.assert_trees_close(
        {name: np.asarray(g) for name, g in result["grads"].items()},
        jax.tree.map(np.asarray, expected_grads),
        rtol=1e-5, atol=1e-6,
    )
    # The gradient (w: 32 bytes) is reduced once, after the micro-batch
    # loop, across the processes; in the loop only scalars (the loss, the
    # token count, the scalar bias b).
    assert all(nbytes < 32 for looped, nbytes in result["reductions"]
               if looped), result["reductions"]
    assert [nbytes for looped, nbytes in result["reductions"]
            if not looped and nbytes >= 32], result["reductions"]


def test_two_processes_run_the_typed_decoder_exactly(results):
  one = tm.on_one_device(tm.Config())
  expected_loss, expected_grads = jax.value_and_grad(tm.loss_fn(one))(
      tm.init(tm.Config()), tm.batch(tm.Config(), problem.TYPED_BATCH))
  pos_bytes = tm.init(tm.Config())["pos"].size * 4
  for result in results:
    typed = result["typed"]
    np.testing.assert_allclose(typed["loss"], expected_loss, rtol=1e-5)
    helpers.assert_trees_close(
        [np.asarray(g) for g in typed["grads"]],
        [np.asarray(g) for g in jax.tree.leaves(expected_grads)],
        rtol=2e-5, atol=2e-6)
    in_loop = sum(n for looped, n in typed["reductions"] if looped and n >= 64)
    # The fallback leaf only (jax 0.9 reduces it in halves over "tensor").
    assert pos_bytes // 2 <= in_loop < pos_bytes + 64
