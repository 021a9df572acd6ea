"""What the unit tests of ``accumulate/``'s modules build by hand.

The settings and the micro-step a layout's ``add`` takes, an Explicit mesh
of the simulated devices, and arrays typed unreduced without a loss to
differentiate: a running sum typed unreduced over the data axes is each
device's part of a value, which :func:`unreduced_from_slots` makes from one
slot per device.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest

from optax_accum._src.accumulate import sum_layout

N = 8  # simulated devices (tests/conftest.py).

# accumulate's defaults: "mean" losses, nothing dropped, every leaf "mean"
# (a checked grad_reduction of None), no statistics.
SETTINGS = sum_layout.UpdateSettings(
    loss_reduction="mean", axis_name=None, skip_nonfinite=False,
    should_skip=None, grad_reduction=None, with_stats=False)

needs_unreduced_types = pytest.mark.skipif(
    not hasattr(P(), "unreduced") or not hasattr(jax.sharding, "reshard"),
    reason="unreduced sharding types need jax >= 0.9.1")


def incoming(grads, num_tokens) -> sum_layout.Incoming:
  """A micro-step as ``update`` hands it to the layout (no ``value``)."""
  return sum_layout.Incoming(grads, num_tokens, jnp.float32(num_tokens),
                             None)


def explicit_mesh(shape=(N,), names=("data",)) -> jax.sharding.Mesh:
  """A mesh of the simulated devices whose axes are all Explicit."""
  return jax.make_mesh(shape, names,
                       axis_types=(AxisType.Explicit,) * len(shape))


@jax.jit
def unreduced_from_slots(slots: jax.Array) -> jax.Array:
  """``slots`` as one array typed unreduced over the axes its slots span.

  ``slots`` has a leading slot axis sharded over some Explicit axes of the
  current mesh (``jax.set_mesh``), one slot per device: each device's slot
  becomes its part, so that the reduction is the sum of the slots. The
  other dimensions keep their spec.
  """
  spec = jax.typeof(slots).sharding.spec
  entries = list(spec) + [None] * (slots.ndim - len(spec))
  over = {entries[0]} if isinstance(entries[0], str) else set(entries[0])
  return jax.shard_map(
      lambda s: s.reshape(s.shape[1:]), in_specs=P(*entries),
      out_specs=P(*entries[1:], unreduced=over), check_vma=False)(slots)
