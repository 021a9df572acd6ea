"""The compiled programs that benchmarks a, b and e time and measure.

``hlo_report.py`` imports these too, so that the HLO it inspects is the very
program that the benchmarks time: same donation, same outputs, same order.
"""

import jax
import jax.numpy as jnp
import optax

import harness

NEVER = 2**30  # every_k for a transformation that never emits.


def param_tree(leaves, size):
  """``leaves`` square float32 parameters and gradients of side ``size``."""
  keys = jax.random.split(jax.random.key(0), 2 * leaves)
  params = {f"w{i}": jax.random.normal(keys[i], (size, size)) * 0.02
            for i in range(leaves)}
  grads = {f"w{i}": jax.random.normal(keys[leaves + i], (size, size)) * 1e-3
           for i in range(leaves)}
  return params, grads


def train_step(tx):
  """``tx.update`` and ``optax.apply_updates``, as a real train step does."""
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def compile_train_step(tx, params, state, grads):
  """:func:`train_step`, the parameters and the state donated."""
  return jax.jit(train_step(tx), donate_argnums=(0, 1)).lower(
      params, state, grads).compile()


def compile_update_step(tx, grads, state, params):
  """``tx.update`` alone, the gradients and the state donated.

  The updates of one call are the gradients of the next: the zero updates of
  a non-emitting step are written into the gradients' buffer instead of
  freshly allocated memory (a fresh 40 MiB output per call costs more in page
  faults than the step itself, and a real train step consumes its updates in
  place). JAX pairs donated inputs with same-shaped outputs in order, so the
  outputs are ordered like the donated inputs: updates (for the gradients),
  then the state.
  """
  def update(grads, state, params):
    return tx.update(grads, state, params)
  return jax.jit(update, donate_argnums=(0, 1)).lower(
      grads, state, params).compile()


def compile_floor(acc, grads):
  """``acc + g`` per leaf, the accumulator donated: read 2N, write N bytes."""
  return jax.jit(lambda a, g: jax.tree.map(jnp.add, a, g),
                 donate_argnums=0).lower(acc, grads).compile()


class Trainer:
  """A donated, ahead-of-time compiled train step and its own copy of state."""

  def __init__(self, tx, params, grads):
    self.params = harness.copy_tree(params)
    self.state = tx.init(self.params)
    self.grads = grads
    self.calls = 0
    self.state_bytes = harness.tree_bytes(self.state)
    self.compiled = compile_train_step(tx, self.params, self.state, grads)

  def steps(self, n):
    for _ in range(n):
      self.params, self.state = self.compiled(self.params, self.state,
                                              self.grads)
    self.calls += n
    jax.block_until_ready((self.params, self.state))


class UpdateOnly:
  """A donated ``tx.update`` alone, no apply_updates: compile_update_step."""

  def __init__(self, tx, params, grads):
    self.params = params
    self.grads = harness.copy_tree(grads)
    self.state = tx.init(params)
    self.calls = 0
    self.compiled = compile_update_step(tx, self.grads, self.state, params)

  def steps(self, n):
    for _ in range(n):
      self.grads, self.state = self.compiled(self.grads, self.state,
                                             self.params)
    self.calls += n
    jax.block_until_ready((self.state, self.grads))


class Floor:
  """The floor of a micro-step: ``acc = acc + g``, jitted and donated."""

  def __init__(self, params, grads):
    self.acc = jax.tree.map(jnp.zeros_like, params)
    self.grads = grads
    self.calls = 0
    self.compiled = compile_floor(self.acc, grads)

  def steps(self, n):
    for _ in range(n):
      self.acc = self.compiled(self.acc, self.grads)
    self.calls += n
    jax.block_until_ready(self.acc)
