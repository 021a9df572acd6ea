"""optax_accum's private modules. Read this code map first.

Two families of entry points share the modules below them.

**One call of** :func:`optax_accum.value_and_grad` (and of
:func:`optax_accum.coupled_value_and_grad`;
:func:`optax_accum.plan_microbatches` compiles such calls) reads as stages in
order, data passing downward:

.. code-block:: text

  value_and_grad.py     checks the arguments once; builds a stages.Program
   |                    (microbatch_loop.program) and runner.Settings
  runner.py             run(): the form, once (forms.py: single / manual /
   |                    auto / typed, by the type of the data axes), and
   |                    its one layout.Layout:
   |                      single    layout.SingleLayout (the identity)
   |                      manual    manual_layout.ManualLayout (shard_map,
   |                                pmap; fsdp.py: the FSDP policy)
   |                      auto      the same, in runner.over_mesh's
   |                                shard_map over the Auto data axes
   |                      typed     typed_layout.TypedLayout, built by
   |                                typed_build.py from one trace (the
   |                                leaves JAX cannot type reduced:
   |                                reduced_fallbacks.py)
   |                    then the same stages in every form:
   |  hold              layout.hold(params)
   |  local             Program.local(held, inputs, layout) -> Partials
   |                      microbatch_loop.py  the scan over micro-batches
   |                        batching.py        split (contiguous / strided)
   |                        loss_signature.py  how loss_fn is called
   |                        token_weighting.py the one weighting rule
   |                        aux_reduction.py   aux_reduction=
   |                        microbatch_rng.py  a key per micro-batch
   |                        noise_scale.py     with_stats sums
   |                      coupled.py + coupled_passes.py  gradient caching
   |  reduce            layout.reduce(partials), the one reduction
   |  finalize          Program.finalize -> stages.Result
  value_and_grad.py     packs the Result like jax.value_and_grad

stages.py holds the NamedTuples that cross those boundaries (Partials,
Result, Program). The loop and gradient caching call only the layout's
methods (layout.Layout, a Protocol): nothing below runner.py asks which
form it is in, and nothing calls back into an entry module.

**One call of** ``oa.accumulate(...).update``:

.. code-block:: text

  accumulate.py         the state, the factory; update(): the form, the
   |                    emit decision, the next AccumulateState
  accumulate_forms.py   detect(): the form of this call, once (SINGLE,
   |                    MANUAL, TYPED, SLOTS) -> a SumLayout (a Protocol)
   |  add               the micro-step, on the layout's sums:
   |                      microstep.py   drops, the lazy-reset add (SINGLE,
   |                                     MANUAL: incoming_grads.py checks)
   |                      typed_sums.py  TYPED: unreduced gradients under
   |                                     jit, the sum unreduced by type
   |                      slot_sums.py   SLOTS: a slot per device under jit
  emitting.py           the lax.cond's emitting branch: layout.reduced (the
                        one reduction per update), inner on the mean

Helpers shared by both: axes.py (manual axes, device_local), sharding.py
(specs, gathers, reduce-scatters), validation.py (argument checks),
partition_specs.py (specs of a state; reduced_state, to save one) and
state_lookup.py (reading an AccumulateState), reducible_layers.py
(add_bias, multiply_scale, reducible_layers), hlo.py
(count_collectives), planner.py (plan_microbatches), caller_warnings.py
(every warning, at the caller's line). compat.py holds the workarounds for
JAX and XLA, each saying what retires it (``grep "Remove when"``).
"""
