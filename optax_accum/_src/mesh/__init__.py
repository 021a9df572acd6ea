"""Sharding types, read and acted on: spec readers, the one shard_map, manual
axes, collectives and the retirable workarounds (see the code map in
``_src``)."""
