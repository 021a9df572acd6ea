"""``oa.plan_microbatches``: the number of micro-batches and the FSDP policy
that fit a memory budget, from compiled steps (see the code map in
``_src``)."""
