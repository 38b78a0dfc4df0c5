"""Real data through a real loader (resilience/data/): the token file is reproducible, every sample carries its id,
ranks split an epoch, a restored loader yields exactly the batches that followed its state, and the exactly-once
ledger finds a skipped or a repeated sample. In-process: rank and world size are passed, no group is needed."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from resilience.data import prepare
from resilience.data.dataset import TokenWindows
from resilience.data.ledger import LedgerWriter, compare_ledgers, read_ledger
from resilience.data.loader import LoaderData
from resilience.data.tokens import SIDECAR, prepare_tokens, token_info

SEQ_LEN, SAMPLES, BATCH, WORLD = 16, 40, 4, 2  # 20 samples per rank: 5 batches an epoch
EPOCHS = 3


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return prepare_tokens(tmp_path_factory.mktemp("tokens"), max_bytes=100_000)


def loader(tokens: Path, rank: int = 0, workers: int = 2, seed: int = 7) -> LoaderData:
    return LoaderData(TokenWindows(tokens, SEQ_LEN, SAMPLES), rank=rank, world_size=WORLD, batch_size=BATCH,
                      seed=seed, num_workers=workers)


def draw(data: LoaderData, n: int) -> list[list[int]]:
    return [data.next_batch()[0].tolist() for _ in range(n)]


def test_the_token_file_is_reproducible_and_reused(tokens, tmp_path):
    again = prepare_tokens(tmp_path / "again", max_bytes=100_000)
    assert again.read_bytes() == tokens.read_bytes() and len(tokens.read_bytes()) == 100_000
    assert token_info(again) == token_info(tokens)
    built = again.stat().st_mtime_ns
    assert prepare_tokens(tmp_path / "again", max_bytes=100_000).stat().st_mtime_ns == built  # reused
    again.write_bytes(b"torn")  # a file that does not match its sidecar is built again
    assert prepare_tokens(tmp_path / "again", max_bytes=100_000).read_bytes() == tokens.read_bytes()
    assert (tmp_path / "again" / SIDECAR).exists()
    with pytest.raises(ValueError, match="data.max_bytes=0"):
        prepare_tokens(tmp_path / "bad", max_bytes=0)


def test_the_prepare_command_says_where_how_big_and_which(tmp_path, capsys):
    assert prepare.main(["--out", str(tmp_path), "--max-bytes", "1000"]) == 0
    info = token_info(tmp_path / "tokens.bin")
    assert capsys.readouterr().out.strip() == f"tokens: {tmp_path / 'tokens.bin'} (1000 bytes, sha256 {info['sha256']})"


def test_each_sample_carries_its_id_and_the_file_window_of_that_id(tokens):
    raw = tokens.read_bytes()
    windows = TokenWindows(tokens, SEQ_LEN, SAMPLES)
    for i in (0, 1, SAMPLES - 1):
        sid, x, y = windows[i]
        want = list(raw[i * SEQ_LEN: i * SEQ_LEN + SEQ_LEN + 1])
        assert sid.item() == i and x.tolist() == want[:-1] and y.tolist() == want[1:]
        assert sid.dtype == x.dtype == y.dtype == torch.int64
    last = len(raw) // SEQ_LEN - 1  # its y ends past the file's end: it wraps to the file's start
    _, x, y = TokenWindows(tokens, SEQ_LEN, last + 1)[last]
    want = list((raw + raw)[last * SEQ_LEN: last * SEQ_LEN + SEQ_LEN + 1])
    assert x.tolist() == want[:-1] and y.tolist() == want[1:] and y[-1].item() == raw[0]
    with loader(tokens) as data:  # and through the workers: every row is the window of the id beside it
        ids, x, y = data.next_batch()
    assert x.shape == y.shape == (BATCH, SEQ_LEN)
    for row, i in enumerate(ids.tolist()):
        assert x[row].tolist() == list(raw[i * SEQ_LEN: (i + 1) * SEQ_LEN])
    with pytest.raises(ValueError, match="data.seq_len"):
        TokenWindows(tokens, 0, SAMPLES)


def test_two_ranks_see_disjoint_ids_that_cover_the_epoch(tokens):
    per_rank = []
    for rank in range(WORLD):
        with loader(tokens, rank=rank, workers=0) as data:
            epochs = [sum(draw(data, data.batches_per_epoch), []) for _ in range(2)]
        per_rank.append(epochs)
    for epoch in range(2):
        a, b = per_rank[0][epoch], per_rank[1][epoch]
        assert not set(a) & set(b) and sorted(a + b) == list(range(SAMPLES))
    assert per_rank[0][0] != per_rank[0][1], "the order is shuffled anew each epoch"
    with pytest.raises(ValueError, match="data.batch_size=21"):
        LoaderData(TokenWindows(tokens, SEQ_LEN, SAMPLES), rank=0, world_size=WORLD, batch_size=21)


def through_every_codec(state: dict) -> dict:
    """The state as the checkpoints carry it: pickled, and through torch.save with weights only on load."""
    buf = io.BytesIO()
    torch.save(pickle.loads(pickle.dumps(state)), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_restored_loader_yields_exactly_the_batches_that_followed_its_state(tokens):
    reference, states = [], []  # the batches, and the state after each, pickled: a part's hash reads those bytes
    with loader(tokens) as data:
        per_epoch = data.batches_per_epoch
        total = EPOCHS * per_epoch
        for _ in range(total):
            reference += draw(data, 1)
            states.append(pickle.dumps(data.state_dict()))
    # mid-epoch; at an epoch's last batch (before and after the next epoch starts); at the second epoch's end
    for cut in (3, per_epoch, per_epoch + 1, 2 * per_epoch, 2 * per_epoch + 2):
        with loader(tokens) as first:
            before = draw(first, cut)
            state = through_every_codec(first.state_dict())
        with loader(tokens) as second:
            second.load_state_dict(state)
            assert pickle.dumps(second.state_dict()) == states[cut - 1]  # unchanged until it draws
            after = draw(second, total - cut)
            # the same state too, byte for byte: a recovered run ends with the fault-free run's loader state
            assert pickle.dumps(second.state_dict()) == states[-1]
        assert before + after == reference, f"resumed after batch {cut}"
    with loader(tokens) as live:  # rolled back in place (a restore point): the same loader loads an older state
        head = draw(live, 3)
        state = live.state_dict()
        draw(live, per_epoch)
        live.load_state_dict(state)
        assert head + draw(live, total - 3) == reference, "rolled back in place"
    # resumed twice in a row
    with loader(tokens) as first:
        head = draw(first, 2)
        state = first.state_dict()
    with loader(tokens) as second:
        second.load_state_dict(state)
        middle = draw(second, per_epoch)
        state = through_every_codec(second.state_dict())
    with loader(tokens) as third:
        third.load_state_dict(state)
        assert head + middle + draw(third, total - 2 - per_epoch) == reference, "resumed twice"


def test_a_state_of_another_layout_is_refused(tokens):
    with loader(tokens, workers=0) as data:
        draw(data, 1)
        state = data.state_dict()
    with loader(tokens, workers=0, seed=8) as other, pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_no_worker_process_survives_close(tokens):
    before = {p.pid for p in multiprocessing.active_children()}
    data = loader(tokens)
    draw(data, 1)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    data.close()
    assert [w.pid for w in workers if w.is_alive() or Path(f"/proc/{w.pid}").exists()] == []
    with pytest.raises(RuntimeError, match="closed"):
        data.next_batch()


KILLED_RANK = """
import json, multiprocessing, multiprocessing.forkserver, sys, time
from resilience.data import fork_server
from resilience.data.dataset import TokenWindows
from resilience.data.loader import LoaderData
forked = sys.argv[2] == "forked" and fork_server.start()
data = LoaderData(TokenWindows(sys.argv[1], 16, 40), rank=0, world_size=2, batch_size=4, num_workers=2)
data.next_batch()
server = multiprocessing.forkserver._forkserver._forkserver_pid
print(json.dumps([p.pid for p in multiprocessing.active_children()] + [server]), flush=True)
time.sleep(60)
"""

BATCHES = """
import hashlib, multiprocessing.forkserver, os, sys
from resilience.data import fork_server
from resilience.data.dataset import TokenWindows
from resilience.data.loader import LoaderData
forked = sys.argv[2] == "forked" and fork_server.start()
server = multiprocessing.forkserver._forkserver._forkserver_pid
with LoaderData(TokenWindows(sys.argv[1], 16, 40), rank=0, world_size=2, batch_size=4, num_workers=2) as data:
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for _ in range(12) for t in data.next_batch()))
parent = open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1] if forked else None
print(forked, parent == str(os.getpid()) if forked else None, digest.hexdigest())
"""


def test_a_fork_server_forked_from_the_rank_serves_the_same_batches(tokens):
    """data.fork_server: the server forked from the rank (its child) yields the batches the stdlib's server does,
    across an epoch's rollover (12 batches of an epoch of 5). The two processes run side by side (~3 s less than
    one after the other: each is mostly its imports, one core each)."""
    procs = {how: subprocess.Popen([sys.executable, "-W", "ignore", "-c", BATCHES, str(tokens), how], text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for how in ("forked", "stdlib")}
    out = {}
    try:
        for how, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{how}: exit {proc.returncode}\n{stderr}"
            out[how] = stdout.split()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert out["forked"][:2] == ["True", "True"] and out["stdlib"][:2] == ["False", "None"]
    assert out["forked"][2] == out["stdlib"][2]


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("server", ["stdlib", "forked"])
def test_the_workers_of_a_killed_rank_end_with_it(tokens, server):
    """A SIGKILLed rank runs no close(); its fork-server workers would outlive it but for die_with_rank, and the
    server (forked from the rank, or the stdlib's) ends with it too."""
    rank = subprocess.Popen([sys.executable, "-W", "ignore", "-c", KILLED_RANK, str(tokens), server],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        workers = json.loads(rank.stdout.readline())
    finally:
        rank.kill()
        rank.wait()
    assert len(workers) == 3  # two workers and their server
    deadline = time.monotonic() + 10
    while not all(map(ended, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if not ended(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "workers outlived their killed rank"


def write(run: Path, rank: int, attempt: int, records: dict[int, list[int]]) -> None:
    with LedgerWriter(run, rank, attempt) as ledger:
        for step, ids in records.items():
            ledger.record(step, torch.tensor(ids, dtype=torch.int64))


def test_the_ledger_keeps_the_latest_attempt_of_a_step_and_drops_a_torn_tail(tmp_path):
    write(tmp_path, 0, 0, {1: [0, 1], 2: [2, 3], 3: [4, 5]})
    write(tmp_path, 1, 0, {1: [6, 7]})
    write(tmp_path, 0, 1, {3: [9, 9], 4: [8]})  # attempt 1 replayed step 3 after a rollback
    torn = tmp_path / "ledger" / "rank1.attempt0.bin"
    torn.write_bytes(torn.read_bytes() + (5).to_bytes(8, "little") + (2).to_bytes(8, "little") + b"\x01")
    assert read_ledger(tmp_path) == {0: {1: [0, 1], 2: [2, 3], 3: [9, 9], 4: [8]}, 1: {1: [6, 7]}}
    write(tmp_path, 1, 0, {2: [10]})  # the same attempt opened again: after its whole records
    assert read_ledger(tmp_path)[1] == {1: [6, 7], 2: [10]}
    with LedgerWriter(tmp_path, 0, 2) as ledger, pytest.raises(ValueError, match="1-D int64"):
        ledger.record(5, torch.tensor([[1]]))


def test_compare_ledgers_finds_a_skipped_and_a_repeated_sample(tmp_path):
    reference = {0: {1: [0, 1], 2: [2, 3]}, 1: {1: [4, 5], 2: [6, 7]}}
    for rank, steps in reference.items():
        write(tmp_path / "same", rank, 0, steps)
    same = compare_ledgers(tmp_path / "same", reference)
    assert same == {**same, "exactly_once": True, "first_diff_step": None, "skipped": 0, "repeated": 0,
                    "steps_checked": 4}
    wrong = {0: {1: [0, 1], 2: [2, 3]}, 1: {1: [4, 5], 2: [5, 7]}}  # rank 1 trained on 5 again instead of 6
    diff = compare_ledgers(wrong, reference)
    assert diff == {**diff, "exactly_once": False, "first_diff_step": 2, "skipped": 1, "repeated": 1}
    extra = compare_ledgers({**reference, 0: {**reference[0], 3: [0]}}, reference)
    assert not extra["exactly_once"] and extra["first_diff_step"] == 3 and extra["repeated"] == 1
