"""The report's Methods section: every metric in plain words, as ``resilience.record.metrics`` computes it.

Keep this in step with ``resilience/record/metrics.py`` (one definition per metric, computed from ``events.jsonl``) and
with the derived columns of ``reports.aggregate`` and ``reports.tables``. Times are seconds on one host's monotonic
clock; "rank 0" means the numbers come from rank 0's events.
"""

from __future__ import annotations

# (metric, definition) in the order a reader meets them in the report.
RESULT_METRICS: list[tuple[str, str]] = [
    ("status", "ok: every step ran and every rank reported its final state; unrecovered: a fault was injected and "
               "the supervisor gave up (restart budget exhausted, or recovery=fail); error: the harness itself "
               "failed."),
    ("attempts", "How many times the group of ranks was started: 1 + the number of restarts."),
    ("steps_completed", "The last training step rank 0 finished in the final attempt."),
    ("wall_time_s", "From the supervisor's launch to its end: process start, rendezvous, every attempt, shutdown."),
    ("step_time_s", "Median duration of rank 0's training steps (forward, backward, optimizer step), all attempts."),
    ("ckpt_count", "Checkpoints rank 0 recorded as durable, over all attempts."),
    ("ckpt_stall_s", "Checkpoint stall: median time from the start of a checkpoint until training may continue "
                     "(what every checkpoint costs the training loop)."),
    ("ckpt_snapshot_stall_s, ckpt_persist_wait_s, ckpt_persist_waits", "The stall apart: the snapshot's own part "
     "(median, the wait left out), and the wait for the previous save's persist that a background save makes "
     "when the interval is shorter than the persist (back-pressure): its mean over every checkpoint, 0 where none "
     "waited, and how many waited."),
    ("ckpt_durable_s", "Time until durable: median time from the start of a checkpoint until it is committed and "
                       "usable for recovery. Equal to the stall for a blocking save; longer for one that persists "
                       "in the background."),
    ("ckpt_bytes", "Median size of a durable checkpoint, all shards together."),
    ("fault_injected, fault_step, fault_rank", "Whether, at which step and on which rank the planned fault fired "
                                               "(its record is written before the fault acts)."),
    ("faults_injected, recoveries, faults", "With several planned faults (fault.at_step=[...]): how many fired, "
                                            "how many training got back from (each fault's step reached again in a "
                                            "run that ended ok), and each one's step, phase, rank, recovery time and "
                                            "lost steps. The other fault and recovery fields describe the first."),
    ("detected, detector, detected_rank", "Whether a detector reported a fault at or after the injection; the first "
                                          "such report names the detector and the rank it blamed."),
    ("detection_latency_s", "From the fault's injection to that first detection."),
    ("false_alarms", "Detections before the fault was injected (in a fault-free run: every detection)."),
    ("recovered", "The run ended ok and training resumed after the fault."),
    ("recovery_time_s", "From the fault's injection until the restarted rank (rank 0 when every rank restarts; "
                        "the replaced rank under strategy=replica) is back at the step where the fault hit (event "
                        "resumed): the training progress is regained."),
    ("recovery_breakdown_s.detect", "Injection to detection (the detection latency)."),
    ("recovery_breakdown_s.restart", "Detection to that rank's start in the new attempt: tearing the old group "
                                     "down, relaunching the processes, rendezvous, process group set-up."),
    ("recovery_breakdown_s.load", "The new attempt's start to its state being loaded: building model and optimizer, "
                                  "then reading the checkpoint or receiving a replica's state (zero when there was "
                                  "nothing to load and training restarted from step 0)."),
    ("recovery_source, recovery_bytes, recovery_load_s", "Where the restarted rank's state came from (disk, own or "
                                                         "peer memory, replica:<rank>), how many bytes it loaded, and "
                                                         "how long the strategy's load itself took."),
    ("survivors_restarted", "Whether the ranks that did not fail were restarted too (false only with "
                            "strategy=replica or swift_log, whose survivors re-form the group in place)."),
    ("ranks_restarted", "The ranks started again in the recovery (every rank when all restart; the lost ones alone "
                        "with strategy=replica or swift_log)."),
    ("recovery_breakdown_s.replay", "Checkpoint loaded to back at the fault's step: recomputing the lost steps."),
    ("mttr_s", "Time to repair: from the fault to training running again (state loaded), detection included, "
               "without the replay of lost work: detect + restart + load. recovery_time_s adds the replay."),
    ("restore_s", "The part of mttr_s after the fault's detection (its injection when no detector of ours saw it): "
                  "restart + load."),
    ("lost_work_s", "The replay in seconds: the time spent recomputing the lost steps (lost_steps counts them)."),
    ("lost_steps", "The fault's step minus the step of the checkpoint the new attempt loaded (minus 0 when it "
                   "started from scratch): work done twice; never below 0 (a replica may be one step past it)."),
    ("goodput", "Productive step time over wall time: the durations of all training steps, each step counted "
                "once, from the attempt whose result survived (a replayed step replaces the lost one), divided by "
                "wall_time_s. Start-up, checkpoint stalls, recovery and lost work all lower it; in these short "
                "runs process start-up dominates, so compare strategies, not absolute values."),
    ("ettr", "Effective training time ratio (Kokolis et al., Revisiting Reliability in Large-Scale Machine "
             "Learning Research Clusters, arXiv:2410.21680): the same productive step time over the job's time "
             "from its first training step to its last. The one-time start-up and tear-down, which a real job "
             "amortizes over days, are outside; every restart, load, replay and checkpoint stall inside counts "
             "against it. This is the figure to compare with published ETTR and goodput."),
    ("validity (noisy)", "A run is noisy when the host was not quiet while it was measured: other processes' CPU "
                         "above validity.max_other_cpu (10% of all cores) or CPU steal above validity.max_steal "
                         "(5%) over the whole run or over any of its checkpoint windows (rank 0's start of a save "
                         "to its durability) or recovery windows (the fault to training back at its step), judged "
                         "over the sampler's readings (every validity.sample_s) that bracket the window; or memory "
                         "pressure above validity.max_memory_pressure over the run. A noisy run's bit-exact check "
                         "counts; its times are kept out of every median, ratio and fit, and the inventory and the "
                         "console line give the reason (where and by how much)."),
    ("final_state_sha256", "SHA-256 of rank 0's final training state. Under train=replayable (the default) that "
                           "is the whole state, model and optimizer: the RNG is re-seeded from (seed, step, rank) "
                           "before every step and a batch is a function of the step, so neither is state. Under "
                           "train=real it is model, optimizer and the job-wide parts (LR schedule, gradient scaler, "
                           "step and sample counters); the per-rank parts (RNG streams, data loader position) are "
                           "checked by state_parts and the ledger."),
    ("state_parts", "Under train=real only (null under train=replayable): each part of the job's state (model, "
                    "optimizer, lr_scheduler, scaler, train_state, rng, dataloader), hashed on every rank at its "
                    "checked points (every checkpoint step, right after every load or in-place recovery, the end) "
                    "and compared with the fault-free reference's hash at the same points: exact, or lost from the "
                    "first step where it differs (docs/job_state.md)."),
    ("ledger", "Under train=real with the token loader: the sample ids each rank trained on at each committed step "
               "(a replayed step counts once, from the attempt that committed it) against the reference's: exactly "
               "once, or how many samples were skipped and repeated and the first step that differs "
               "(docs/job_state.md)."),
    ("replicas_agree", "Every rank ended with the same final state hash."),
]

DERIVED_METRICS: list[tuple[str, str]] = [
    ("matches_reference (bit-exact)", "The run's final state hash equals that of the fault-free reference run "
                                      "with the same workload, world size, steps and seed. A recovered run that "
                                      "matches lost no update and replayed every step exactly. Empty when either "
                                      "run has no final state (unrecovered, failed). Under train=real the final "
                                      "hash does not cover the RNG streams and the data loader: the next row does."),
    ("what each technique restores", "Under train=real: state_parts and ledger recomputed by the pipeline against "
                                     "the cell's own reference cell (the same run the bit-exact column uses; "
                                     "resilience.record.job_state). A row is a strategy and fault over its runs: "
                                     "a part lost in any run is lost, from the earliest step."),
    ("write bandwidth", "ckpt_bytes / ckpt_durable_s, per run, in MB/s (10^6 bytes); the table shows the median "
                        "over runs, and its share of the probed disk write bandwidth of this machine."),
    ("checkpoint overhead", "ckpt_stall_s / (checkpoint.every x step_time_s): the stall as a share of the "
                            "training time between two checkpoints."),
    ("detection coverage", "Of the runs with a given fault and a given detector configured, the share in which "
                           "that detector was the first to report the fault."),
    ("ratios to sync", "Each value divided by the sync strategy's value for the same column (and fault): below "
                       "1 is less time (or fewer steps) than sync, above 1 more."),
    ("n and interval", "Under every median: n, the runs it is the median of, and an exact distribution-free "
                       "confidence interval of the median from order statistics, with its level (Conover, Practical "
                       "Nonparametric Statistics, 3rd ed., 1999, section 3.2). From 6 runs: the 95% interval "
                       "[x_(k), x_(n-k+1)] with the largest k for which 1 - 2 P(Binomial(n, 1/2) <= k-1) >= 0.95 "
                       "(ranks 1 and 6 of 6 runs, 2 and 9 of 10, 6 and 15 of 20). With 2 to 5 runs no rank reaches "
                       "95%: the interval is the runs' range [x_(1), x_(n)], shown with its exact level 1 - 2/2^n "
                       "(50% at n=2, 75% at n=3, 87.5% at n=4, 93.75% at n=5). One run has none. Repeats (the "
                       "matrix's repeat axis) and seeds both count as runs (reports/stats.py)."),
    ("ratio interval and difference", "A ratio to sync (or to the best library) carries an interval built from "
                                      "the two medians' exact intervals, [low / sync high, high / sync low], at "
                                      "the Bonferroni level 1 - (1 - ca) - (1 - cb) of the two sides' levels ca "
                                      "and cb: 95% where the narrowest choice of ranks reaches it (7 runs on each "
                                      "side, or fewer on one against more on the other), else the runs' ranges at "
                                      "their combined level, which is stated (3 runs against 3: 50%). A strategy "
                                      "is called lower or higher than sync only where the two medians' 95% "
                                      "intervals do not overlap; where both exist and overlap the table says \"no "
                                      "measurable difference\" (a conservative test), and where a side has fewer "
                                      "than 6 runs \"not compared: fewer than 6 runs\". Figures read median "
                                      "[low, high] n (the interval 95% unless its level is written after n: \"n=3 "
                                      "at 75%\"), a ratio x ratio [low, high]."),
    ("coverage interval", "A detector's coverage (k of n runs) carries the exact Clopper-Pearson 95% interval "
                          "(Clopper and Pearson, Biometrika 26(4), 1934)."),
    ("state (pipeline)", "ok or unrecovered: the harness worked (exit 0); failed: harness failure (exit 1), a "
                         "crash or the time limit; invalid: the configuration was rejected (exit 2)."),
]

AGGREGATION = ("Tables show the median over a cell group's runs (seeds, repeats and, where not broken out, checkpoint "
               "intervals) of runs in state ok; unrecovered runs count only for bit-exactness (they have none) and "
               "the inventory. Medians, not means, because a single slow start-up on a shared machine would "
               "otherwise move a mean of two or three runs.")
