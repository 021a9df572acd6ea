"""Eight simulated CPU devices for every test, the doctests of optax_accum/
included (set before jax starts its backends; see tests/conftest.py)."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
