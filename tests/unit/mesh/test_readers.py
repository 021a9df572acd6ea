"""``readers``: spec surgery on the specs read off types."""

from jax.sharding import PartitionSpec as P

from optax_accum._src.mesh import readers


def test_restrict_keeps_only_the_named_axes():
  spec = P(("data", "model"), "fsdp", None)
  assert readers.restrict(spec, "data") == P("data")
  assert readers.restrict(spec, ("data", "fsdp")) == P("data", "fsdp")
  assert readers.restrict(spec, "tensor") == P()
