"""Which tests CI leaves to ``make test-long``: the sweeps, each beside the test that keeps its kind in CI.

``make test`` (what ``.ci/run`` runs) has a 15-minute goal on 2 idle cores; ``make test-long`` runs the tests below
(``pytest --long``; ``pytest --all`` runs both sets). Every check stays in the project: a test moves here only when
CI keeps a real-process test of the same role kind and the same fault kind (named after ``#``), so what lands here
is the second and further strategy, library or phase of one mechanism. A test named on the command line
(``pytest tests/x.py::test_y``) runs whatever its tier.
"""

from __future__ import annotations

LONG: dict[str, str] = {
    # a save on notice of an in-memory strategy, to disk: CI keeps sync's save on notice
    "tests/test_preempt.py::test_a_preempted_job_resumes_bit_exact_and_a_save_on_notice_loses_nothing"
    "[inmemory-save-on-notice]": "strategy sweep",
    # the outside crash tester over sync's saves (an optional extra, skipped where it is not installed): CI keeps
    # async's kill in a save (tests/test_strategies.py) and the job killed in a save
    "tests/test_chaos.py::test_ckpt_chaos_passes_every_crash_point_of_syncs_saves": "outside crash tester",
    # kill and recover per sharded strategy: CI keeps fsdp-sync-kill and hsdp-inmemory-node_loss
    "tests/test_sharded.py::test_sharded_kill_and_recover_bit_exact[hsdp-dcp_async-kill]": "sharded sweep",
    "tests/test_sharded.py::test_sharded_kill_and_recover_bit_exact[fsdp-async-kill]": "sharded sweep",
    # pipeline parallelism: CI keeps the replicated pipeline's kill (tests/test_pipeline_dp.py) and swift_log's,
    # each compared with its fault-free run
    "tests/test_pipeline_parallel.py::test_a_fault_free_pipeline_run_repeats_bit_for_bit":
        "CI keeps pp_dp's and swift_log's kills, each compared with its fault-free run",
    "tests/test_pipeline_parallel.py::test_a_killed_stage_restarts_with_every_rank_and_ends_bit_exact"
    "[before_forward]": "CI keeps pp_dp's kill before the forward pass, which makes every assertion of this one",
    "tests/test_pipeline_parallel.py::test_a_killed_stage_restarts_with_every_rank_and_ends_bit_exact"
    "[during_checkpoint]": "kill phase sweep",
    # replicated pipelines: CI keeps the kill of one replica's rank, compared with the fault-free run
    "tests/test_pipeline_dp.py::test_a_fault_free_replicated_pipeline_run_repeats_bit_for_bit":
        "CI keeps the kill's run compared with the fault-free one",
    "tests/test_pipeline_dp.py::test_a_stages_replicas_average_its_gradients_summed_in_rank_order":
        "CI keeps the ordered reduction on 4 ranks (tests/test_reduce.py), whose sum it shares",
    # replica's heal of a stage from its twin: CI keeps the last stage's kill before the forward pass
    "tests/test_pipeline_dp.py::test_a_killed_stage_alone_is_replaced_and_healed_from_its_twin_bit_exact"
    "[rank1-before_forward]": "killed stage sweep",
    "tests/test_pipeline_dp.py::test_a_killed_stage_alone_is_replaced_and_healed_from_its_twin_bit_exact"
    "[rank3-before_optimizer_step]": "kill phase sweep",
    "tests/test_pipeline_dp.py::test_both_replicas_of_a_stage_lost_end_the_run_unrecoverable_saying_which":
        "fault sweep (tests/test_replica.py keeps every replica lost in CI)",
    # Swift's replay of one stage from its neighbour's log: CI keeps 1F1B trained and replayed, part of the log spilled
    "tests/test_boundary_log.py::test_each_stage_replayed_alone_from_its_neighbours_log_ends_on_its_fault_free_state"
    "[gpipe-trained-1f1b-replayed-on-disk]": "schedule and spill sweep",
    # strategy=swift_log: CI keeps the last stage killed, replaced alone and replayed bit exact; the first stage, a
    # kill in the replay and the loss of both stages are the same recovery's sweeps
    "tests/test_swift_log.py::test_a_killed_stage_alone_restarts_and_replays_from_its_neighbours_log_bit_exact"
    "[during_checkpoint]": "kill phase sweep",
    "tests/test_swift_log.py::test_the_first_stage_killed_replays_from_the_last_stages_gradients_bit_exact":
        "killed stage sweep",
    "tests/test_swift_log.py::test_a_kill_during_the_replay_replaces_the_stage_again_and_ends_bit_exact":
        "kill phase sweep",
    "tests/test_swift_log.py::"
    "test_the_loss_of_the_stage_holding_the_log_too_restarts_both_from_the_checkpoint_bit_exact": "fault sweep",
    "tests/test_swift_log.py::test_a_warm_spare_takes_the_lost_stage_and_ends_bit_exact": "spare sweep",
    "tests/test_swift_log.py::test_with_a_clip_the_replay_clips_by_the_logged_norms_of_every_stage_bit_exact":
        "loop settings sweep",
    "tests/test_swift_log.py::test_selective_logging_on_two_stages_steps_every_stage_back_in_place_bit_exact":
        "log setting sweep",
    # resharding 4 -> 2: CI keeps 2 -> 4 (tests/test_grow.py)
    "tests/test_sharded.py::test_a_checkpoint_of_4_shards_loads_on_2_ranks_as_the_saved_global_state": "resharding",
    # the libraries on sharded models: CI keeps our sharded strategies and each library unsharded
    "tests/test_sharded_nvrx.py::test_hsdp_killed_during_a_save_recovers_bit_exact": "library x parallelism",
    "tests/test_torch_checkpointing.py::test_fsdp_killed_during_a_save_recovers_bit_exact": "library x parallelism",
    # a library's resharded loads, 4 -> 2 -> 4: CI keeps DCP's 2 -> 4 (tests/test_grow.py)
    "tests/test_torch_checkpointing.py::test_a_world_shrunk_and_grown_back_ends_where_dcps_resharded_loads_end":
        "resharding",
    "tests/test_sharded_dlrover.py::test_hsdp_killed_in_a_save_restores_every_rank_from_dlrovers_memory_bit_exact":
        "library x parallelism",
    # torchsnapshot's finding on 4 ranks (every way of saving raises): CI keeps its refusal of sharded state
    "tests/test_sharded_torchsnapshot.py::test_on_4_ranks_every_way_of_saving_raises_on_every_rank":
        "library x parallelism",
    "tests/test_hsdp_replica.py::test_hsdp_replica_moves_one_shard_and_ends_bit_exact": "recovery x parallelism",
    # a kill in each library's save: CI keeps torch_checkpointing's, dlrover_flash's memory recovery and ours
    # (tests/test_strategies.py)
    "tests/test_peers.py::test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact[dlrover_flash]":
        "crash sweep",
    "tests/test_peers.py::test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact[torchsnapshot]":
        "crash sweep",
    "tests/test_peers.py::test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact[nvrx_async]": "crash sweep",
    "tests/test_peers.py::test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact[dcp_async_staged]":
        "crash sweep",
    "tests/test_peers.py::test_kill_during_a_save_loads_the_previous_checkpoint_bit_exact[dcp_async_process]":
        "crash sweep",
    # a damaged checkpoint rejected, writers with a checkpoint process: CI keeps [dcp_async] (the same load and check:
    # dcp_async_process is dcp_async saving from a process, nvrx_async_dcp is committed like sync and loaded through
    # DCP; torch_checkpointing's checksums checked before the load, agreed_entry, are torchsnapshot's and
    # nvrx_async's, kept too) and torch_checkpointing's kill in a save (tests/test_torch_checkpointing.py)
    "tests/test_rejected_load.py::test_a_rejected_checkpoint_leaves_the_state_as_it_was[torch_checkpointing]":
        "writer sweep",
    "tests/test_rejected_load.py::test_a_rejected_checkpoint_leaves_the_state_as_it_was[dcp_async_process]":
        "writer sweep",
    "tests/test_rejected_load.py::test_a_rejected_checkpoint_leaves_the_state_as_it_was[nvrx_async_dcp]":
        "writer sweep",
    # DLRover's memory copy: CI keeps the declared copy's recovery
    "tests/test_peers.py::test_dlrover_memory_recovery_as_shipped_and_with_the_declared_copy"
    "[dlrover_flash_shipped-False]": "library as shipped",
    "tests/test_peers.py::test_dlrover_node_loss_takes_the_memory_copy_with_it": "node loss, covered by inmemory's",
    # DLRover's standalone saver, fault-free: CI keeps dlrover_flash's kill recovered from memory, which checks the
    # library record and the shared memory and sockets left, and the standalone saver's rejected load
    # (tests/test_rejected_load.py)
    "tests/test_peers.py::test_fault_free_run_is_bit_exact_and_declares_the_library[dlrover_flash_standalone]":
        "library mode sweep",
    # the real loop: CI keeps the three kills and the negative control that restores the loader but not the RNG
    "tests/test_job_state.py::test_fp16_a_kill_after_steps_the_scaler_skipped_recovers_exact": "precision sweep",
    "tests/test_job_state.py::test_the_negative_controls_are_named_not_exact_with_the_parts_they_lose"
    "[sync_model_only-must_lose0]": "second negative control",
    "tests/test_multi_fault.py::test_three_kills_one_during_a_save_are_each_recovered_and_the_run_ends_bit_exact":
        "covered by the real loop's three kills (tests/test_job_state.py)",
    "tests/test_own_model.py::test_own_models_run_in_a_pipeline_matrix": "CI keeps the user module's kill run",
    # detectors and launchers: CI keeps one real-process test of each
    "tests/test_detectors.py::test_a_slow_save_is_not_a_hang_but_a_stall_is": "detector nuance",
    "tests/test_nvrx_heartbeat.py::test_fault_free_run_has_no_verdict": "CI keeps its kill-the-hung-rank run",
    "tests/test_ft_launcher.py::test_a_hung_rank_is_killed_by_nvrx_and_the_run_recovers_bit_exact":
        "CI keeps NVRx's heartbeat under our launcher and ft_launcher's fault-free run",
    "tests/test_nvrx_inprocess.py::test_fault_free_run_is_the_plain_run": "CI keeps its in-process restart",
    "tests/test_recovery.py::test_torchrun_two_nodes_recover_bit_exact": "CI keeps tests/test_torchrun.py",
    # two fault-free runs agree bit for bit, and no detector alarms: CI holds test_pool's cold run to the session's
    # reference, which asserts its own false alarms (tests/conftest.py)
    "tests/test_recovery.py::test_fault_free_runs_are_deterministic":
        "CI keeps test_pool's cold fault-free run, held to the session's reference",
    "tests/test_faults.py::test_fault_scenario[hang-sigstop]": "CI keeps hang-stall",
    "tests/test_faults.py::test_fault_scenario[torn_write]":
        "CI keeps the disk fault's slow and ENOSPC modes and a damaged checkpoint rejected "
        "(tests/test_rejected_load.py)",
    # sync's rank 1 SIGKILLed before the forward pass: CI keeps test_pool's SIGKILL run (tests/test_pool.py), which
    # checks the same verdict, blame and survivor exit
    "tests/test_faults.py::test_fault_scenario[kill]": "CI keeps test_pool's SIGKILL run",
    # a node lost: CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py) and sync's node lost and returned
    # (tests/test_grow.py); a restart from a disk checkpoint is kept by the kills
    "tests/test_faults.py::test_fault_scenario[node_loss]": "fault x strategy sweep",
    # a weight's bit flipped: CI keeps the flip detected and rolled back (tests/test_detectors.py)
    "tests/test_faults.py::test_fault_scenario[bitflip-weights]": "the flip undetected, diverging",
    # the same mechanism at another step or phase
    # inmemory's restart from memory: CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py), which holds every
    # rank's source and step; a kill is kept in CI for every other strategy
    "tests/test_inmemory.py::test_recovery_source_and_bit_exact[kill]":
        "CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py)",
    "tests/test_inmemory.py::test_recovery_source_and_bit_exact[whole-world-one-node]":
        "inmemory sweep; CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py)",
    "tests/test_inmemory.py::test_recovery_source_and_bit_exact[kill-mid-snapshot]":
        "inmemory sweep; CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py)",
    "tests/test_inmemory.py::test_recovery_source_and_bit_exact[node-loss-peer-copy]":
        "CI keeps hsdp-inmemory-node_loss (tests/test_sharded.py)",
    "tests/test_preempt.py::test_a_preempted_job_resumes_bit_exact_and_a_save_on_notice_loses_nothing[no-save]":
        "CI keeps the save on notice, and a job killed and resumed (tests/test_job_resume.py)",
    # a killed job resumed in a new one: CI keeps sync's as the pipeline runs it, one cell, checked as the test
    # below checks it (tests/test_job_resume.py)
    "tests/test_job_resume.py::test_a_killed_job_resumes_in_a_new_job_bit_exact[sync]":
        "CI keeps the same job killed and resumed as a pipeline cell",
    "tests/test_job_resume.py::test_a_killed_job_resumes_in_a_new_job_bit_exact[async]":
        "CI keeps sync's resume as a pipeline cell (test_the_pipeline_runs_a_killed_job_and_its_resume_as_one_cell)",
    "tests/test_failure_trace.py::test_a_traced_run_meets_every_planned_failure_and_ends_on_the_fault_free_state":
        "CI keeps the kills and node losses it is made of (tests/test_recovery.py, tests/test_sharded.py, "
        "tests/test_grow.py)",
    # a kill in a save, as a pipeline cell, leaving nothing in /dev/shm: CI keeps torch_checkpointing's kill in a
    # save (tests/test_torch_checkpointing.py), a library whose checkpoint process takes the tensors through shared
    # memory, checked by run_experiment's left_nothing
    "tests/test_pipeline.py::test_a_kill_during_a_save_cell_leaves_no_shared_memory_behind[dcp_async_process]":
        "library sweep",
    "tests/test_pipeline.py::test_a_kill_during_a_save_cell_leaves_no_shared_memory_behind[nvrx_async]":
        "CI keeps torch_checkpointing's kill in a save, whose checkpoint process takes the tensors through /dev/shm",
    "tests/test_recovery.py::test_kill_and_recover_bit_exact[async-3]": "kill-step sweep",
    "tests/test_recovery.py::test_kill_and_recover_bit_exact[none-0]":
        "CI keeps the smoke matrix's none x kill, matched with its reference (tests/test_pipeline.py)",
    "tests/test_drain.py::test_a_notice_too_short_for_the_move_is_a_node_loss_recovered_bit_exact":
        "CI keeps the drain's move and the node losses (tests/test_sharded.py, tests/test_grow.py)",
    "tests/test_recovery.py::test_kill_and_recover_bit_exact[sync-2]": "kill-step sweep",
    # a kill of an async-snapshot strategy: CI keeps async's kill in a save (during_checkpoint)
    "tests/test_strategies.py::test_kill_and_recover_bit_exact[async-before_forward]":
        "CI keeps async's during_checkpoint",
    "tests/test_strategies.py::test_kill_and_recover_bit_exact[dcp_async-before_forward]":
        "CI keeps async's during_checkpoint",
    "tests/test_strategies.py::test_kill_and_recover_bit_exact[dcp_async-during_checkpoint]":
        "CI keeps async's during_checkpoint",
    # Check-N-Run's chains killed on 2 ranks: CI keeps the incremental and quantized chains in process
    # (tests/test_incremental.py: a chain restores its newest link, a broken link falls back, a quantized chain
    # approximates the tables; tests/test_rejected_load.py [incremental] and [quantized]) and a disk strategy's kill
    # restarted from its checkpoint (tests/test_strategies.py [async-during_checkpoint], tests/test_recovery.py
    # [sync-1])
    "tests/test_incremental.py::"
    "test_two_ranks_killed_after_several_increments_recover_bit_exact_and_quantized_by_design_not":
        "strategy sweep",
    "tests/test_replica.py::test_survivors_keep_running_and_end_bit_exact[hang-1]": "replica sweep",
    # a warm spare replacing a killed rank: CI keeps the replica's kill (survivors_keep_running[kill-0-mid-step]) and
    # the drain's warm spare, which heals from a live replica with its state built initialised (tests/test_drain.py)
    "tests/test_replica.py::test_survivors_keep_running_and_end_bit_exact[spare]": "replica sweep",
    # dlrm_emb's replacement built uninitialised: CI keeps the kill of gpt_tiny's and dlrm_emb's heal in process
    # (tests/test_uninitialised.py)
    "tests/test_replica.py::test_a_dlrm_replacement_built_uninitialised_ends_bit_exact": "workload sweep",
    # a cold spare racing the survivor's last 17 steps: on a VM whose cold start takes 5 s (2026-11-28) it came up
    # after the last step, idle; CI keeps the warm spare that takes a drained rank at once (tests/test_drain.py)
    "tests/test_replica.py::test_while_replacing_continue_trains_at_reduced_width_and_heals_consistent[spare]":
        "host-timed spare race",
    "tests/test_replica.py::test_while_replacing_continue_trains_at_reduced_width_and_heals_consistent[late]":
        "replica sweep",
    "tests/test_replica.py::test_reconcile_redoes_the_step_and_fills_a_replacement[65536]": "bucket-size sweep",
    # a reconcile at step 0: CI keeps test_reconcile_redoes_the_step_and_fills_a_replacement[None]
    "tests/test_replica.py::test_reconcile_at_step_zero_moves_nothing": "CI keeps reconcile [None]",
    "tests/test_replica_torchft.py::test_with_every_group_required_the_survivor_waits_and_the_heal_is_bit_exact":
        "CI keeps the kill-and-heal run",
    "tests/test_replica_torchft.py::test_as_shipped_the_survivor_of_a_kill_mid_allreduce_crashes":
        "library as shipped",
    # torchft's fault-free run: CI keeps the kill-and-heal run, held to the session's reference
    "tests/test_replica_torchft.py::test_fault_free_run_commits_every_step_at_full_width_bit_exact":
        "CI keeps the kill-and-heal run",
    # strategy=jit: CI keeps the kill and world_size=1 with no replica left; the hang and the collective timeout are
    # kept in CI for sync (tests/test_detectors.py), the real loop's kills for sync (tests/test_job_state.py)
    "tests/test_jit.py::test_a_survivor_writes_the_last_step_and_the_restart_replays_at_most_the_one_in_flight"
    "[kill-after-reduce]": "kill phase sweep",
    "tests/test_jit.py::test_a_survivor_writes_the_last_step_and_the_restart_replays_at_most_the_one_in_flight"
    "[hang]": "fault sweep",
    "tests/test_jit.py::test_a_survivor_writes_the_last_step_and_the_restart_replays_at_most_the_one_in_flight"
    "[collective-timeout]": "fault sweep",
    "tests/test_jit.py::test_the_whole_job_state_comes_back_each_rank_s_own_parts_from_node_memory": "job state sweep",
    "tests/test_jit.py::test_no_healthy_replica_left_is_said_and_the_run_goes_on_from_what_there_is"
    "[node-loss-of-the-world]": "CI keeps world_size=1",
    # jit's shards under HSDP: CI keeps jit's kills unsharded and HSDP under inmemory (tests/test_sharded.py)
    "tests/test_jit.py::test_under_hsdp_each_shard_is_written_by_one_survivor_and_the_set_is_committed":
        "recovery x parallelism",
    # strategy=shadow: CI keeps the kill after the reduction; the whole job state is kept for sync
    # (tests/test_job_state.py), as for jit; a node loss is kept in CI for inmemory (tests/test_sharded.py)
    "tests/test_shadow.py::test_a_kill_restarts_from_the_shadow_bit_exact_losing_at_most_one_step[node-loss]":
        "fault sweep",
    # CI keeps shadow's kill after the reduction
    "tests/test_shadow.py::test_a_kill_restarts_from_the_shadow_bit_exact_losing_at_most_one_step"
    "[kill-before-forward]": "kill phase sweep",
    "tests/test_shadow.py::test_a_kill_restarts_from_the_shadow_bit_exact_losing_at_most_one_step"
    "[kill-while-publishing]": "kill phase sweep",
    "tests/test_shadow.py::test_the_whole_job_state_comes_back_each_rank_s_parts_from_the_shadow": "job state sweep",
    # the scaler's skipped step end to end (fp16 on CPU is slow): CI keeps it in the shadow's unit test
    "tests/test_shadow.py::test_a_step_the_scaler_skipped_is_a_step_of_the_shadow_too": "CI keeps the unit test",
    # projection and matrices: CI keeps the default matrix's cells checked in process and the smoke matrix end to end
    "tests/test_parity.py::test_costs_fitted_on_one_measured_run_predict_another": "two measured runs",
    # the projection command end to end: CI keeps the smoke matrix's project rule, the same CLI, with its console and
    # Monte Carlo checks (tests/test_pipeline.py)
    "tests/test_projection.py::test_cli_end_to_end_writes_outputs": "CI keeps the smoke matrix's project rule",
    # Snakemake's plan of the default matrix: CI keeps the default matrix's cells checked in process and the smoke
    # matrix's dry run end to end (test_smoke_matrix_end_to_end)
    "tests/test_pipeline.py::test_dry_run_of_a_matrix_plans_each_cell_once[default]": "big matrix",
    # the probe command's figures and console: CI keeps the smoke matrix's probe, the same command at RB_PROBE_MB's size
    "tests/test_probe.py::test_probe_command_prints_and_writes_the_figures": "CI keeps the smoke matrix's probe",
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[peers]": "big matrix",
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[recovery_peers]":
        "big matrix",
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[sharded]": "big matrix",
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[full]": "big matrix",
    # CI keeps tests/test_report_job_state.py, which checks every cell of job_state
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[job_state]":
        "big matrix",
    # test_interval's matrix test (tests/test_interval.py) loads techniques
    "tests/test_pipeline.py::test_every_cell_of_every_other_matrix_passes_the_commands_checks[techniques]":
        "big matrix",
}
