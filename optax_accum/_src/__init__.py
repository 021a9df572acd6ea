"""optax_accum's private modules. Read this code map first.

Two families of entry points share the modules below them.

**One call of** :func:`optax_accum.value_and_grad` (and of
:func:`optax_accum.coupled_value_and_grad`;
:func:`optax_accum.plan_microbatches` compiles such calls) reads as stages in
order, data passing downward:

.. code-block:: text

  value_and_grad.py     checks the arguments once; builds a stages.Program
   |                    (microbatch_loop.program) and runner.Settings
  runner.py             run(): the dispatch by form (forms.py), then
   |  forms.py            SINGLE / MANUAL (shard_map, pmap) /
   |                      TYPED (jit, Explicit data axes) / MESH (jit, Auto)
   |  (TYPED)            typed_form.run(): split, hold (typed_layout.py:
   |                      parameters reduced, sums unreduced), local,
   |                      one reshard, finalize; reduced_fallbacks.py finds
   |                      the leaves JAX cannot type reduced
   |  (MESH)             over_mesh(): a shard_map over the data axes around
   |                      on_device()
   |  on_device()        gather: fsdp.hold (FSDP layouts, fsdp.py)
   |                     local: Program.local -> stages.Partials
   |                       microbatch_loop.py  the scan over micro-batches
   |                         batching.py        split (contiguous / strided)
   |                         loss_signature.py  how loss_fn is called
   |                         token_weighting.py the one weighting rule
   |                         aux_reduction.py   aux_reduction=
   |                         microbatch_rng.py  a key per micro-batch
   |                         noise_scale.py     with_stats sums
   |                       coupled.py + coupled_passes.py  gradient caching
   |                     reduce: runner.reduce -> fsdp.finish, once
   |                     finalize: Program.finalize -> stages.Result
  value_and_grad.py     packs the Result like jax.value_and_grad

stages.py holds the NamedTuples that cross those boundaries (Partials,
Result, Program). Nothing below runner.py calls back into an entry module.

**One call of** ``oa.accumulate(...).update``:

.. code-block:: text

  accumulate.py         the micro-step: checks (incoming_grads.py), drops,
   |                    the lazy-reset add (token_weighting.py), the emit
   |                    decision, the next AccumulateState
  emitting.py           the lax.cond's emitting branch: the one reduction per
                        update (partial_sums.py), inner on the mean

The loop and gradient caching call their layout's functions (hold,
for_microbatch, zero_grads, add_grads, finish) on either an fsdp.Layout
(manual axes) or a typed_layout.Layout (Explicit axes, in the types).

Helpers shared by both: axes.py (manual axes, device_local), sharding.py
(specs, gathers, reduce-scatters), validation.py (argument checks),
partition_specs.py and state_lookup.py (reading an AccumulateState), hlo.py
(count_collectives), planner.py (plan_microbatches), caller_warnings.py
(every warning, at the caller's line).
"""
