"""The event catalogue: every kind of event in ``events.jsonl``, its required fields, who emits it, what it means.

``EventLog.emit`` refuses a kind that is not here and an event without its required fields, so the log's contract
is written once and a reader can rely on it (``resilience.record.query`` reads the shared quantities from it). A
plug-in role that records a kind of its own registers it with ``register`` when its module is imported, beside its
class (as it brings its YAML). ``docs/architecture.md`` shows this table (``markdown``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable

# Who writes an event: the supervisor process, the rank's own loop, or a role inside one of them.
EMITTERS = ("supervisor", "rank", "strategy", "detector", "injector", "recovery")
# Every event carries these (``EventLog.emit`` adds them): clocks, who, which attempt and step, and the kind.
COMMON_FIELDS = ("t_wall", "t_mono", "rank", "attempt", "step", "kind", "host")


@dataclass(frozen=True)
class EventKind:
    """One kind of event: ``fields`` are required besides the common ones (an emitter may add more)."""

    name: str
    emitters: tuple[str, ...]
    fields: tuple[str, ...]
    meaning: str


_KINDS: dict[str, EventKind] = {}


def register(name: str, emitters: Iterable[str], fields: Iterable[str], meaning: str) -> EventKind:
    """Catalogue a kind (a plug-in's own, at its module's import); registering the same entry again is a no-op."""
    kind = EventKind(name, tuple(emitters), tuple(fields), meaning)
    unknown = sorted(set(kind.emitters) - set(EMITTERS))
    if not kind.emitters or unknown:
        raise ValueError(f"event kind {name!r}: emitters {list(kind.emitters)}; each one of {', '.join(EMITTERS)}")
    if set(kind.fields) & set(COMMON_FIELDS):
        raise ValueError(f"event kind {name!r}: {sorted(set(kind.fields) & set(COMMON_FIELDS))} are common fields")
    known = _KINDS.get(name)
    if known is not None and known != kind:
        raise ValueError(f"event kind {name!r} is already catalogued differently: {known}")
    _KINDS[name] = kind
    return kind


def lookup(name: str) -> EventKind:
    """The catalogued kind ``name``; ``ValueError`` naming it if there is none."""
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"event kind {name!r} is not in the event catalogue (resilience/record/catalogue.py); "
                         "catalogue it there, or register it from the plug-in's module (catalogue.register)")
    return kind


def check(name: str, fields: Collection[str]) -> None:
    """Refuse an event of an uncatalogued kind, or one without the fields its kind requires."""
    missing = [f for f in lookup(name).fields if f not in fields]
    if missing:
        raise ValueError(f"event {name!r} lacks its required field(s) {', '.join(missing)} (the event catalogue)")


def kinds() -> list[EventKind]:
    """Every catalogued kind, in the catalogue's order (plug-ins' last)."""
    return list(_KINDS.values())


def markdown() -> str:
    """The catalogue as a Markdown table (the section of ``docs/architecture.md``)."""
    rows = [f"| `{k.name}` | {', '.join(k.emitters)} | {', '.join(f'`{f}`' for f in k.fields) or '-'} | {k.meaning} |"
            for k in kinds()]
    return "\n".join(["| kind | emitted by | required fields | meaning |", "|---|---|---|---|", *rows])


# The shipped kinds, by emitter. The required fields are those every emitter of the kind writes and readers rely on.
_SUPERVISOR: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("launch", ("world_size", "max_restarts", "recovery"),
     "the supervisor starts the ranks: a run's time starts here (its `supervisor`: preloaded when forked from the "
     "pipeline's pool, else cold)"),
    ("detector_unavailable", ("detector", "reason"), "a configured detector cannot run on this host"),
    ("restart", ("policy", "restart", "max_restarts"),
     "the supervisor starts ranks again: all of them, or (with `ranks`) the failed ones, started `spawned_s_before` "
     "this event (while their incident settled)"),
    ("unrecoverable", ("ranks", "reason"), "the run ends before its restart budget: no restart can mend it"),
    ("node_returned", ("ranks", "after_s"), "recovery=grow: the lost node is back"),
    ("world_resized", ("world_size", "previous", "direction"),
     "recovery=shrink|grow: the ranks go on at another world size from the checkpoint of `step`"),
    ("host_memory", ("peak_pss_bytes", "samples"), "the run's process tree's peak memory (PSS)"),
    ("orphans_killed", ("processes",), "processes a rank left behind, killed at the end of the run"),
    ("shm_leftovers_removed", ("files", "bytes"),
     "torch's shared-memory files the run's ended processes left in /dev/shm, removed at the end of the run"),
    ("host_load", ("thresholds",), "the host's load while the run ran, and the validity thresholds"),
    ("supervisor_end", ("outcome", "signal"), "the supervisor is done: succeeded, failed or interrupted"),
    ("job_lost", ("died_t_wall", "last_attempt", "last_step", "found_by"),
     "the previous job ended without its end record (its supervisor was killed): recorded by whoever learns of it "
     "first (`found_by`: the resume), with its last event's time and its last attempt and step"),
    ("job_resumed", ("job", "first_attempt", "started_t_wall"),
     "resume=: a new job (number `job`, its process started at `started_t_wall`) continues the run, its attempts "
     "numbered on from `first_attempt`"),
)
_RANK: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("run_start", ("pid", "world_size", "device", "backend", "preloaded", "preload_s", "age_s", "join_s"),
     "a rank process is set up and about to load (preloaded: forked from the zygote, resilience.proc.zygote; "
     "preload_s: the imports it did not pay, its zygote's and the pipeline pool's, None when cold; "
     "age_s: since the process was created, join_s: of that, forming its process group)"),
    ("step_end", ("loss", "duration_s"), "a training step is done; `duration_s` is its loop iteration"),
    ("resumed", ("fault_step",), "a restarted rank is back at the step where the fault hit (replay over)"),
    ("recovery_requested", ("reaction", "detector", "rollback_to"), "a detection asks the supervisor for a restart"),
    ("rank_error", ("error",), "the rank fails with this exception"),
    ("run_end", ("final_state_sha256", "peak_rss_mb"), "the rank trained every step; the hash of its final state"),
    ("notice", ("noticed_s",), "checkpoint.on_notice: the ranks agree at the end of `step` that a preemption's "
     "SIGTERM came (`noticed_s` ago on this rank)"),
    ("notice_saved", ("saved_s",), "the checkpoint of `step` saved on the notice is durable, `saved_s` after it; "
     "the rank ends and the run goes on in a new job"),
    ("drained", ("noticed_s",), "fault=drain: the ranks agreed at the end of `step` that this one leaves its node "
     "(`noticed_s` after its maintenance notice); it ends and a spare takes its rank"),
    ("parts_hashed", ("parts", "why"), "train=real: the SHA-256 of each part of the job's state at `step` (`why`: "
     "checkpoint step, loaded, recovered or end), compared with the fault-free run's at the same step"),
)
_STRATEGY: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("ckpt_begin", (), "a checkpoint is due: training stops for it (the stall begins)"),
    ("ckpt_stall_end", (), "training may go on (the stall ends); the save may still be persisting"),
    ("ckpt_durable", ("bytes", "path"), "rank 0 committed the checkpoint of `step`: a restart may load it"),
    ("ckpt_written", (), "a background persist: this rank's shard of the checkpoint of `step` is on disk (what is "
     "left is handing its write results to rank 0, which commits alone)"),
    ("ckpt_pruned", (), "the checkpoint of `step` was removed (checkpoint.keep)"),
    ("ckpt_failed", ("error",), "a save failed; training goes on without that checkpoint"),
    ("ckpt_skipped", ("reason",), "a due save was skipped (when_busy=skip: the previous persist is in flight)"),
    ("ckpt_persist_waited", ("duration_s",), "the stall waited this long for the previous persist (when_busy=wait)"),
    ("ckpt_interval", ("interval", "reason"), "checkpoint.every=auto chose the interval from this step on, and why "
     "(rank 0)"),
    ("snapshot_reserved", ("bytes", "duration_s"), "host buffers for snapshots were allocated ahead of the first"),
    ("ckpt_loaded", ("source", "bytes", "duration_s"), "the state of `step` was restored, from `source`"),
    ("ckpt_read_verified", ("files", "of_files", "bytes"), "a load read and checksummed these files"),
    ("ckpt_incomplete", ("path",), "an uncommitted checkpoint directory was passed over"),
    ("ckpt_rejected", ("path", "reason"), "a committed checkpoint failed its check and was passed over"),
    ("ckpt_loaded_inexact", ("why",), "the load restored an approximation of the saved state, by design (the "
     "strategy's caps `inexact_restore`): the run is not held to the bit-exact check"),
    ("ckpt_memory_saved", ("duration_s",), "a snapshot of `step` is complete in host memory"),
    ("ckpt_peer_copied", ("peer_rank", "duration_s"), "the snapshot was copied to the peer's memory"),
    ("ckpt_memory_loaded", ("source", "agree_s", "read_s", "restore_s"), "a load from host memory, its phases"),
    ("ckpt_memory_fallback", ("reason", "memory_steps"), "no snapshot in memory serves: the load goes to disk"),
    ("ckpt_memory_corrupt", ("source", "area"), "a snapshot in memory failed its checksum"),
    ("peer_library", ("library", "version", "settings", "patches"), "the library a peer strategy runs"),
    ("replica_mode", ("while_replacing",), "strategy=replica: how survivors behave while a rank is replaced"),
    ("replica_heal", ("source", "transfer_s", "bytes", "heal_s"), "a replacement took a replica's state (under "
     "parallel=pp_dp its `stage`'s, from its twin)"),
    ("peer_lost", ("error",), "a collective failed: a replica peer is gone"),
    ("handover", ("leaving", "replace_timeout_s"), "fault=drain: a staying rank waits at the end of `step` for "
     "the spares of the ranks `leaving` their node, to heal them"),
    ("reduced_group", ("generation", "participants", "replacing", "duration_s"),
     "survivors train on in a smaller group while the lost ranks are replaced"),
    ("replacement_too_slow", ("waited_s",), "no replacement came within the deadline: this survivor gives up"),
    ("rejoined", ("generation", "from_step", "source", "received", "bytes", "rejoin_s", "duration_s"),
     "a survivor is back in the full group with the replacement (under parallel=pp_dp with its `stage` and "
     "`regroup_s`: its pipeline's and stage's groups and its schedule formed again)"),
    ("log_discarded", ("dropped", "held_bytes", "spilled_bytes", "entries"), "strategy=swift_log: the checkpoint of "
     "`step` is committed; the stage's log entries before it were dropped, what it holds now (`held_peak`: the most "
     "held so far, `step_bytes_max`: the most one step logged)"),
    ("stage_loaded", ("bytes", "duration_s"), "strategy=swift_log: a replaced stage loaded its own state of `step` "
     "(0: no checkpoint, the seed's), by itself, while the other stages kept theirs"),
    ("stage_replayed", ("from_step", "steps", "duration_s", "received_bytes", "sources"), "strategy=swift_log: a "
     "replaced stage replayed `steps` steps from `from_step` to `step` from the logs its neighbours (`sources`) sent"),
    ("stage_rejoined", ("generation", "replaced", "kept", "sent_bytes", "duration_s"), "strategy=swift_log: the "
     "stages go on together from `step` after stages `replaced` restarted (`kept`: this stage kept its state)"),
    ("jit_saved", ("bytes", "duration_s", "shard", "path"), "strategy=jit: a survivor of a failure wrote its "
     "replica's state of `step` (its shard `shard`), `duration_s` after its collective failed"),
    ("jit_unsaved", ("reason",), "strategy=jit: a survivor of a failure wrote nothing, or a rank could not keep its "
     "own parts (`reason`)"),
    ("jit_no_replica", ("reached", "lost_steps", "reason"), "strategy=jit: no survivor wrote the state of the step "
     "the failed attempt `reached` (every replica lost at once): the run goes on from `step`, `lost_steps` back"),
    ("jit_parts_lost", ("ranks", "parts"), "strategy=jit: these ranks' own parts (RNG, data position) at the loaded "
     "`step` are in no node's memory: they start over"),
    ("jit_parts_kept", ("count", "duration_s", "bytes"), "strategy=jit: this rank kept its own parts in node memory "
     "`count` times in the attempt, in `duration_s` all told (the steady state's cost), `bytes` a copy"),
    ("ft_heal", ("from_step", "transfer_s", "bytes", "heal_s"), "torchft: a behind group took a peer's state"),
    ("ft_quorum", ("participants", "previous", "groups", "wait_s"), "torchft: a new quorum formed"),
    ("ft_step", ("participants", "committed"), "torchft: a step and whether the quorum committed it"),
    ("ft_state", ("participants", "sha256"), "torchft: the state hash of a new quorum's first step"),
    ("ft_incomplete", ("participants",), "torchft: the run ended before every group held the final state"),
)
_DETECTOR: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("fingerprint_coverage", ("every", "slice_bytes", "rest_bytes", "coverage_checks", "coverage_steps"),
     "replica_fingerprint: how much of the state a check covers, and in how many steps all of it"),
    ("fingerprint_interval", ("every", "anchor", "check_s", "step_s", "budget"),
     "replica_fingerprint every=auto: the interval decided after step `anchor` from the slowest check and the fastest "
     "step (rank 0)"),
    ("fingerprint_check", ("compute_s", "gather_s"), "replica_fingerprint: the cost of one check"),
)
for _emitters, _group in ((("supervisor",), _SUPERVISOR), (("rank",), _RANK), (("strategy",), _STRATEGY),
                          (("detector",), _DETECTOR)):
    for _name, _fields, _meaning in _group:
        register(_name, _emitters, _fields, _meaning)
# Detectors run in the ranks and in the supervisor; ft_launcher's heartbeat and NVRx's in-process hooks detect too.
register("fault_detected", ("detector", "supervisor", "recovery"), ("detector", "blamed_rank", "verdict"),
         "a detector's verdict: a fault (or a false alarm before any), whom it blames")
register("fault_injected", ("injector",), ("fault", "phase", "plan_index", "target_rank", "seed"),
         "the ground truth: an injector fires now, at `step`; a wall-clock trace's (fault.clock=wall, from the "
         "supervisor) says what it `struck`: training, restarting (the recovery starts over) or none (no process: "
         "the next one is killed), and when: `planned_s` after the first step's start")
register("inprocess_attempt", ("recovery",), ("library", "version", "iteration", "pid", "settings", "patches"),
         "recovery=nvrx_inprocess: an in-process restart iteration begins")
