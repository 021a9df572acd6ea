"""Test configuration: eight simulated CPU devices for the sharding tests.

Strict dtype promotion is switched on per test around our own code
(``jax.numpy_dtype_promotion("strict")``), not globally: optax's own
optimizers rely on standard promotion.
"""

import os

# Must be set before jax initialises its backends.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
)
