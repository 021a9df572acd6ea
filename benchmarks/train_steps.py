"""The compiled programs that benchmarks a, b and e time and measure.

``hlo_report.py`` imports these too, so that the HLO it inspects is the very
program that the benchmarks time: same donation, same outputs, same order.
"""

import jax
import jax.numpy as jnp
import optax

import harness
import optax_accum as oa

NEVER = 2**30  # every_k for a transformation that never emits.
# ``apply`` of train_step: ``oa.update_and_apply``, applied in the branch.
IN_BRANCH = "oa.update_and_apply"


def param_tree(leaves, size):
  """``leaves`` square float32 parameters and gradients of side ``size``."""
  keys = jax.random.split(jax.random.key(0), 2 * leaves)
  params = {f"w{i}": jax.random.normal(keys[i], (size, size)) * 0.02
            for i in range(leaves)}
  grads = {f"w{i}": jax.random.normal(keys[leaves + i], (size, size)) * 1e-3
           for i in range(leaves)}
  return params, grads


def apply_always(params, updates, state):
  """``optax.apply_updates``, whether ``tx.update`` emitted or not."""
  del state
  return optax.apply_updates(params, updates)


def train_step(tx, apply=apply_always):
  """``tx.update`` and ``apply(params, updates, state)``, as a train step does.

  ``apply`` is :func:`apply_always`, ``oa.apply_if_updated`` or
  :data:`IN_BRANCH` (``oa.update_and_apply`` does both).
  """
  if apply == IN_BRANCH:
    return lambda params, state, grads: oa.update_and_apply(
        tx, grads, state, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates, state), state
  return step


def compile_train_step(tx, params, state, grads, apply=apply_always):
  """:func:`train_step`, the parameters and the state donated."""
  return jax.jit(train_step(tx, apply), donate_argnums=(0, 1)).lower(
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

  def __init__(self, tx, params, grads, apply=apply_always):
    self.params = harness.copy_tree(params)
    self.state = tx.init(self.params)
    self.grads = grads
    self.calls = 0
    self.state_bytes = harness.tree_bytes(self.state)
    self.compiled = compile_train_step(tx, self.params, self.state, grads,
                                       apply)

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


def probe_batch(size, rows=4):
  """Inputs of :func:`probe_loss`: ``rows`` random rows of width ``size``."""
  return jax.random.normal(jax.random.key(1), (rows, size))


def probe_loss(params, x):
  """A loss whose gradient is a dot per leaf, as a model's backward pass is.

  XLA cannot fuse a dot's output into the add that consumes it, so the
  gradient is a temporary of the train step, as in a real one.
  """
  return sum(jnp.sum((x @ w) ** 2) for w in params.values())


class GradTrainer:
  """A donated train step that computes its gradient: grad, update, apply."""

  def __init__(self, tx, params, x, apply=apply_always):
    self.params = harness.copy_tree(params)
    self.state = tx.init(self.params)
    self.x = x
    self.calls = 0

    def step(params, state, x):
      grads = jax.grad(probe_loss)(params, x)
      updates, state = tx.update(grads, state, params)
      return apply(params, updates, state), state

    self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        self.params, self.state, x).compile()

  def steps(self, n):
    for _ in range(n):
      self.params, self.state = self.compiled(self.params, self.state, self.x)
    self.calls += n
    jax.block_until_ready((self.params, self.state))


class GradFloor:
  """The floor of such a micro-step: the gradient, added to an accumulator.

  The accumulator (donated) stands for the parameters the gradient is taken
  at; what matters is the same gradient computation and one add.
  """

  def __init__(self, params, x):
    self.acc = harness.copy_tree(params)
    self.x = x
    self.calls = 0

    def step(acc, x):
      return jax.tree.map(jnp.add, acc, jax.grad(probe_loss)(acc, x))

    self.compiled = jax.jit(step, donate_argnums=0).lower(self.acc,
                                                          x).compile()

  def steps(self, n):
    for _ in range(n):
      self.acc = self.compiled(self.acc, self.x)
    self.calls += n
    jax.block_until_ready(self.acc)
