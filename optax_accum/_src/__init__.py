"""optax_accum's private modules. Read this code map first.

Seven folders, one per family, and seven modules that the families
share. Imports run downward only, in this order
(``tests/unit/test_layers.py`` fails on a cycle or an import that runs
back up):

.. code-block:: text

  planner/   proving/         plan_microbatches; proving a user's own
                              step (check_k_invariance)
  nnx_optimizer.py            AccumulatingOptimizer, an nnx.Optimizer
                              around accumulate (flax imported on use)
  microbatch/   accumulate/   the two entry-point families (neither
                              imports the other)
  rules/   compiled/          the arithmetic both families share; the
                              readers of compiled programs
  mesh/                       reading and moving shardings
  validation.py               argument checks
  conditional_loops.py        conditionals written as loops (run_if,
                              scan_if), differentiated as lax.cond
  names.py                    the named scopes the families write and
                              the readers look for; gradient_sync's values
  tree_match.py               a prefix spread over a tree, and where two
                              trees differ, named by path
  flax_nnx.py                 the mistakes Flax NNX trees allow, named
                              (flax looked up, never imported)
  caller_warnings.py          every warning at the caller's line
  keyword_names.py            other libraries' keyword names, named
                              with ours

The five modules below ``conditional_loops.py`` import nothing of ours.

**rules/**: the arithmetic both entry points share. ``token_weighting``
(the one weighting rule, ``num_tokens`` missing), ``grad_reduction``
(``grad_reduction=``: mean, max or last per leaf), ``aux_reduction``
(``aux_reduction=`` over micro-batches and devices), ``noise_scale``
(``GradStats`` and its sums). What they do per device goes through
``mesh/manual``: ``token_weighting`` divides an unreduced sum on each
device's own blocks (``on_own_partials``, a shard_map), ``grad_reduction``
keeps a "max" leaf on the axis' first device (``on_first_device``).

**mesh/**: sharding types, read and acted on. ``readers`` holds every
reader of specs and meshes off types (``full_spec``, ``unreduced_axes``,
``axis_sizes``, ...) and imports nothing of ours; ``manual`` is the one
door to ``jax.shard_map``: its ``shard_map`` (entered by
``microbatch/runner``'s auto form, ``microbatch/typed_noise``'s device rows
and ``compat``) and ``on_own_partials``, a function on each device's own
blocks (entered by ``collectives``, ``compat``, ``rules/token_weighting``
and accumulate's ``microstep``, ``slot_sums``, ``typed_sums`` and
``saved_state``), beside
the first-device helpers, which run inside manual axes without entering
any; ``axes`` the manual axes (varying, ``device_local``, their checks);
``collectives`` gathers, reduce-scatters and psums by spec, and the
deferred forms' add and reduction (``add_to_partials``,
``reduce_scatter_unreduced``); ``zero`` the ZeRO shard of each leaf
(``zero_specs``); ``compat`` only the retirable JAX and XLA workarounds.
Every shim, wherever it lives, says what retires it:
``grep -rn "Remove when"``.

**microbatch/**: one call of :func:`optax_accum.value_and_grad` or
:func:`optax_accum.coupled_value_and_grad`
(:func:`optax_accum.plan_microbatches` compiles such calls), k micro-batches
in one loop (a ``lax.scan``; with ``borrowing``, a while loop of k trips).
The call reads as stages in order, data passing downward:

.. code-block:: text

  value_and_grad.py     checks the arguments once; builds a layout.Program
   |  coupled.py        (loop_program.program; coupled's two passes) and
   |                    runner.Settings
  runner.py             run(): the form, once (forms.detect_form: single,
   |                    manual, auto or typed, by the type of the data
   |                    axes); param_specs checked against the mesh and
   |                    the policy against the leaves (fsdp.check_fits_mesh,
   |                    fsdp.warn_if_sync_unused); its one layout.Layout:
   |                      single    layout.SingleLayout (the identity)
   |                      manual    manual_layout.ManualLayout (shard_map,
   |                                pmap; fsdp.py: the FSDP policy)
   |                      auto      the same, in runner.over_mesh's
   |                                shard_map over the Auto data axes
   |                      typed     typed_layout.TypedLayout, built from
   |                                one trace (typed_trace.build_typed; the
   |                                leaves JAX cannot type reduced:
   |                                reduced_fallbacks, cast_checks; noise
   |                                rows: typed_noise)
   |                    then the same stages in every form:
   |  hold              layout.hold(params)
   |  local             Program.local(held, inputs, layout) -> Partials
   |                      loop.py            the scan over micro-batches
   |                        trip_count.py      all k trips, the first
   |                                           num_real, or borrowing's
   |                        batching.py        split (contiguous, strided)
   |                        borrowing.py       an empty micro-batch runs a
   |                                           kept one's data, zero seed
   |                        empty_safe.py      elsewhere, its derivative a
   |                                           cond: no NaN under jax.grad
   |                        layer_sums.py      the running sums handed
   |                                           to the last micro-batch's
   |                                           layer scan (scanned_layers:
   |                                           oa.scan_layers)
   |                        loss_signature.py  how loss_fn is called
   |                        rng.py             a key per micro-batch
   |  reduce            layout.reduce(partials), the one reduction
   |  finalize          Program.finalize -> layout.Result
   |                      loop_program.py    the loop's sums as results
  value_and_grad.py     packs the Result like jax.value_and_grad

The loop and gradient caching call only the layout's methods (the
``layout.Layout`` Protocol): nothing below ``runner.py`` asks which form it
is in, and nothing calls back into an entry module. ``reducible_layers``
(``add_bias``, ``multiply_scale``, ``reducible_layers``) is the typed
form's too, though the user calls it: it runs inside ``loss_fn`` on every
micro-batch, a bias add and a scale that JAX types reduced, so that no leaf
falls back. ``scanned_layers`` (``oa.scan_layers``) is the user's too: a
``lax.scan`` the model runs its stacked layers with, which in the last
micro-batch (``overlap_reduction=True``, manual axes) reduces each layer's
slice inside the backward loop, the loop handing it the running sums.

**accumulate/**: one call of ``oa.accumulate(...).update`` (or of its
``update_and_apply``), one micro-batch per call, as stages in order:

.. code-block:: text

  transform.py          the factory (an AccumulateTransformation: init,
   |                    update, update_and_apply); init() refuses a
   |                    wrapper that would skip our update, then lays
   |                    the state out by the form layout_for picks
   |                    (layout.init -> state.first_state)
  update_call.py        one update call (Step): layout_for(), the form,
   |                    once (the one place it is decided, for init and
   |                    update) -> a sum_layout.SumLayout:
   |                      single    local_sums.SingleSums
   |                      manual    local_sums.ManualSums (shard_map, pmap)
   |                      typed     typed_sums.TypedSums (unreduced
   |                                gradients under jit, sums unreduced)
   |                      slots     slot_sums.SlotSums (a slot per device
   |                                under jit)
   |                      ZeRO      zero_sums.ZeroSums (shard_optimizer:
   |                                inner on shards, around the typed or
   |                                single form's add; or ZeRO by Flax:
   |                                optimizer_sharding Variables at init,
   |                                an inner state that came sharded at
   |                                update, zero_sums.sharded_by_inner)
   |  add               layout.add(Incoming): microstep.py (the checks,
   |                    the drops, the lazy-reset add; add_on_device for
   |                    the deferred forms) and window_args.py (the extra
   |                    args over the window)
   |  emit or skip      emit.py: output_for picks the outputs.Output
   |                    (Updates, UpdatesInSum, Applied); decide(): one
   |                    choose() for emit, layout.reduced (the one
   |                    reduction per update), one choose() for a cycle
   |                    with tokens, Emitter.run (inner on the mean,
   |                    traced once)
  state.py              AccumulateState, its start and next value

``sum_layout.py`` holds the Protocol and the tuples that cross module lines
(``UpdateSettings``, ``Start``, ``Incoming``, ``Cycle``, ``MicroStep``).
``state_access.py`` reads a state (``find_accumulate_state``,
``has_updated``, ``grad_stats``, ``tokens_seen``); ``applying.py`` applies
its updates (``apply_if_updated``, ``update_and_apply``);
``state_specs.py`` gives a state's specs and ``reduced_state`` (an
``accumulate`` state laid out for a shard_map or a checkpoint);
``saved_state.py`` saves one mid-cycle as it lies (``checkpointable_state``,
``restored_state``: each device's partial sum in its own slot of a
checkpoint, and back). Nothing below
``update_call.layout_for`` asks which form it is in.

**compiled/**: readers of compiled programs, opt-in and off every hot
path, all on one parser of compiled HLO text, ``hlo_text``, whose public
names are the folder's inside. ``hlo`` (``count_collectives``;
``async_chains`` reads XLA TPU's asynchronous collective fusions),
``self_check`` (``check_train_step``: judges what ``step_reading`` reads,
the micro-batch loop's trip count and where the gradient is reduced),
``overlap`` (``reduction_overlap``: ``reduction_spans`` reads where each
reduction starts and is done, ``model_loops`` those inside a model's own
loops, ``matmul_flops`` counts the matrix multiplies),
``memory_analysis`` (a compiled program's memory).
It imports nothing from ``microbatch/`` or ``accumulate/``: the named
scopes it looks for come from ``names``.

**planner/**: ``planner`` (``plan_microbatches``, on ``planner_step``'s
step and ``memory_analysis``' reading of its memory).

The same words name the forms in both families: *single* (no data axis),
*manual* (data axes made manual: shard_map, pmap), *typed* (Explicit data
axes under jit, the reduction in the types); ``value_and_grad`` adds
*auto* (Auto data axes, entered by the runner's shard_map) and
``accumulate`` *slots* (a state laid out per device, under jit).
"""
