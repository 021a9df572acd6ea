"""Models and compile-only devices shared by tests/ and benchmarks/.

Not part of optax_accum (the wheel ships ``optax_accum*`` only): our own
code for checking and measuring it, in one place, imported from the
repository root as ``from zoo import typed_model``.

- :mod:`zoo.typed_model`: a decoder written the way JAX's Training Cookbook
  teaches, for ``jax.jit`` with Explicit axes (the typed form's tests and
  benchmarks j, k and l).
- :mod:`zoo.models`: the benchmarks' models: a compute-bound MLP, a small
  transformer, an abstract Llama-shaped decoder (shapes only) and a Flax NNX
  decoder written as a new user writes it.
- :mod:`zoo.losses`: what every model's loss shares: the mean over unmasked
  tokens and the token count.
- :mod:`zoo.compile_only`: compile-only TPU and GPU devices (SPEC 11), for
  ``tests/compiled/`` and benchmark k.

``tests/`` and ``benchmarks/`` find it on ``sys.path`` through the
repository root: pytest puts the root there (the root ``conftest.py``),
``benchmarks/run.py`` adds it, and ``harness.in_child`` passes it to child
processes.
"""
