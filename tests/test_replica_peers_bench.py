"""The replica benchmark's arithmetic (``resilience.bench.replica_peers``) on hand-written results: the floor is the
probed rank start plus one transfer of the healed bytes, and the ratio is per run."""

from __future__ import annotations

from resilience.bench.replica_peers import floor_s, row

LIMITS = {"rank_start_s": 1.5, "p2p_GBps": 2.0}


def test_floor_is_a_process_start_plus_one_transfer_at_the_probed_bandwidth():
    assert floor_s(4_000_000_000, LIMITS) == 1.5 + 2.0
    assert floor_s(None, LIMITS) is None


def test_row_gives_medians_with_their_range_and_the_ratio_to_the_floor():
    runs = [{"status": "ok", "recovery_time_s": t, "heal_bytes": 1_000_000_000, "replacement_start_s": 1.0,
             "replicas_consistent": True, "bit_exact": None} for t in (4.0, 6.0, 8.0)]
    r = row("gpt_small", "replica", runs, LIMITS)  # floor 1.5 + 0.5 = 2 s
    assert r["ok"] == "3/3" and r["recovery s"] == "6.00 [4.00, 8.00]" and r["recovery / floor"] == "3.00 [2.00, 4.00]"
    assert r["floor s"] == "2.00 [2.00, 2.00]" and r["consistent"] == "3/3" and r["not bit-exact by design"] == "0/3"
    assert r["heal s"] == "-"  # a measure no run reported
