"""What a pipeline stage sends across its boundaries, per step and micro-batch (Swift's logging, Zhong et al., TPDS
2024): the activations it sends forward to the next stage, the input gradients it sends back to the previous one.

A stage logs what it *sends*: its neighbours' logs hold what it received, so a stage that fails replays from them
(``stage_replay.py``) while they keep their state. An entry is the tensors of one send, copied as they leave (their
exact bytes); the log keeps them in memory up to ``budget_bytes``, then spills the oldest to disk, one file per
entry, sealed with a checksum (``ckpt/sealed.py``): a damaged spill file is refused (``DamagedLog``), never replayed.
``discard_before(step)`` drops what a checkpoint made useless. Entries travel between ranks in the same sealed form
(``export`` / ``adopt``). See docs/pipeline_parallel.md, "The boundary log and the replay".

Steps are the loop's: step ``t`` trains from position ``t`` (``t`` optimizer steps applied) on batch ``t``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from resilience.ckpt import sealed
from resilience.settings.checks import require_int

FORWARD, BACKWARD = "fwd", "bwd"  # activations sent to the next stage, input gradients sent to the previous one
KINDS = frozenset((FORWARD, BACKWARD))
MAGIC = b"RBBLOG01"
_META = struct.Struct("<I")  # the length of an entry's JSON header (each tensor's dtype and shape)


class DamagedLog(ValueError):
    """An entry cut short, damaged or of another key: the replay stops rather than train on wrong bytes."""


class Key(NamedTuple):
    step: int
    kind: str
    micro: int

    @property
    def tag(self) -> int:  # the sealed header's tag: the micro-batch and the direction
        return self.micro * 2 + (self.kind == BACKWARD)


def sends_logged(stage: int, stages: int, every: int = 1) -> frozenset[str]:
    """What ``stage`` logs under selective logging: boundary ``b`` (between stages ``b - 1`` and ``b``) is logged
    when ``b % every == 0``, so the stages between two logged boundaries fail and replay as one group (Swift's
    trade of log size against recovery work; ``every=1`` logs every boundary, each stage replays alone)."""
    require_int("swift_log.every", every, 1)
    kinds = set()
    if stage < stages - 1 and (stage + 1) % every == 0:
        kinds.add(FORWARD)
    if stage > 0 and stage % every == 0:
        kinds.add(BACKWARD)
    return frozenset(kinds)


def encode(tensors: tuple[torch.Tensor, ...]) -> bytes:
    """The tensors' dtypes, shapes and exact bytes, as one payload."""
    head = json.dumps([[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]).encode()
    raw = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join([_META.pack(len(head)), head, *raw])


def decode(payload: bytes) -> tuple[torch.Tensor, ...]:
    (n,) = _META.unpack_from(payload, 0)
    offset, out = _META.size + n, []
    for dtype_name, shape in json.loads(payload[_META.size:offset]):
        dtype = getattr(torch, dtype_name)
        t = torch.empty(shape, dtype=dtype)
        size = t.numel() * t.element_size()
        if size:
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(payload[offset:offset + size]),
                                                                dtype=torch.uint8))
        out.append(t)
        offset += size
    return tuple(out)


class BoundaryLog:
    """One stage's log of its sends (``kinds`` of them), in memory up to ``budget_bytes`` (None: no limit), the
    rest spilled to ``spill_dir``; ``fsync`` for spill files that must outlive the machine (a killed process loses
    nothing the kernel holds)."""

    def __init__(self, kinds: frozenset[str] = KINDS, budget_bytes: int | None = None,
                 spill_dir: Path | None = None, fsync: bool = False) -> None:
        if budget_bytes is not None:
            require_int("swift_log.budget_bytes", budget_bytes, 0)
            if spill_dir is None:
                raise ValueError(f"swift_log.budget_bytes={budget_bytes}: a budget needs a spill directory")
        self.kinds, self.budget, self.fsync = frozenset(kinds), budget_bytes, fsync
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.step: int | None = None  # the step whose sends are being recorded (``begin``)
        self._memory: dict[Key, tuple[torch.Tensor, ...]] = {}  # in the order recorded: the oldest spills first
        self._spilled: dict[Key, int] = {}  # key -> bytes of its file
        self.held_bytes = 0  # the tensors' bytes held in memory now
        self.held_peak = 0  # the most held at once (within the budget): the log's memory cost over the run
        self.step_bytes_max = 0  # the most one step logged (kept past discard_before, which empties bytes_by_step)
        self.bytes_by_step: dict[int, int] = {}  # the tensors' bytes logged per step (held or spilled)
        self.spilled_total = 0  # bytes written to spill files since the start (the disk traffic)
        # train.clip_norm: per step, every stage's gradient norm in stage order (what the clip divided by), and the clip
        self.norms: dict[int, torch.Tensor] = {}
        self.max_norm: float | None = None

    def begin(self, step: int) -> None:
        """The sends that follow are step ``step``'s."""
        self.step = step

    def record(self, kind: str, micro: int, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> int:
        """Copy what one send op carries (its tensors, in op order) into the log; the bytes logged (0: not a kind
        this log keeps)."""
        if kind not in self.kinds:
            return 0
        if self.step is None:
            raise RuntimeError("BoundaryLog.record before begin(step): the entry would have no step")
        copies = tuple(t.detach().clone() for t in tensors)  # a send is asynchronous: the copy is its bytes now
        return self.put(Key(self.step, kind, micro), copies)

    def record_norms(self, norms: list[torch.Tensor], max_norm: float) -> None:
        """Keep this step's gradient norm of every stage (0-d tensors, in stage order) and the clip they served: a
        stage replayed alone clips by them, its own checked against the one it had."""
        if self.step is None:
            raise RuntimeError("BoundaryLog.record_norms before begin(step): the norms would have no step")
        self.norms[self.step] = torch.stack([n.detach().reshape(()) for n in norms]).cpu()
        self.max_norm = max_norm

    def put(self, key: Key, tensors: tuple[torch.Tensor, ...]) -> int:
        """Keep ``tensors`` (the log's own from here on) under ``key``, replacing an entry there; their bytes."""
        self.drop(key)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._memory[key] = tensors
        self.held_bytes += nbytes
        self.bytes_by_step[key.step] = self.bytes_by_step.get(key.step, 0) + nbytes
        self._enforce_budget()
        self.held_peak = max(self.held_peak, self.held_bytes)
        self.step_bytes_max = max(self.step_bytes_max, self.bytes_by_step[key.step])
        return nbytes

    def get(self, step: int, kind: str, micro: int) -> tuple[torch.Tensor, ...]:
        """The tensors of one logged send (the log's own: read, not written); ``KeyError`` if never logged (or
        discarded), ``DamagedLog`` if its spill file no longer holds them."""
        key = Key(step, kind, micro)
        if key in self._memory:
            return self._memory[key]
        if key not in self._spilled:
            raise KeyError(f"boundary log: no {kind} entry for step {step}, micro-batch {micro}")
        found = sealed.read(self._path(key), MAGIC)
        if found is None or found[:2] != (key.step, key.tag):
            raise DamagedLog(f"boundary log: spill file {self._path(key)} is missing, damaged or of another entry")
        return decode(found[2])

    def keys(self) -> list[Key]:
        return sorted([*self._memory, *self._spilled])

    def discard_before(self, step: int) -> int:
        """Drop every entry of a step before ``step`` (a checkpoint at position ``step`` replaces them); the
        entries dropped."""
        old = [k for k in self.keys() if k.step < step]
        for key in old:
            self.drop(key)
        for s in [s for s in self.bytes_by_step if s < step]:
            del self.bytes_by_step[s]
        for s in [s for s in self.norms if s < step]:
            del self.norms[s]
        return len(old)

    def drop(self, key: Key) -> None:
        """Forget one entry, in memory or on disk (its bytes stay counted in ``bytes_by_step``: they were logged)."""
        if key in self._memory:
            tensors = self._memory.pop(key)
            self.held_bytes -= sum(t.numel() * t.element_size() for t in tensors)
        elif self._spilled.pop(key, None) is not None:
            self._path(key).unlink(missing_ok=True)

    @property
    def spilled_bytes(self) -> int:
        """The spill files' bytes on disk now."""
        return sum(self._spilled.values())

    def stats(self) -> dict[str, int]:
        """What the log costs now, ready for an event: memory held (now and at most), disk held, entries, the last
        step's bytes and the most one step logged."""
        last = max(self.bytes_by_step, default=None)
        return {"held_bytes": self.held_bytes, "held_peak": self.held_peak, "spilled_bytes": self.spilled_bytes,
                "spilled_total": self.spilled_total, "entries": len(self._memory) + len(self._spilled),
                "last_step": -1 if last is None else last,
                "last_step_bytes": 0 if last is None else self.bytes_by_step[last],
                "step_bytes_max": self.step_bytes_max}

    def export(self, first: int, last: int, kind: str) -> bytes:
        """The ``kind`` entries of steps ``first..last``, sealed and laid end to end: what a neighbour sends to a
        stage that replays those steps (``adopt``)."""
        out = []
        for key in self.keys():
            if key.kind == kind and first <= key.step <= last:
                payload = encode(self.get(*key))
                out += [sealed.head(MAGIC, key.step, key.tag, payload), payload]
        return b"".join(out)

    def adopt(self, blob: bytes) -> int:
        """Take in the entries another log exported, each checked against its checksum; the entries taken."""
        offset, taken = 0, 0
        while offset < len(blob):
            found = sealed.unseal(blob, MAGIC, offset)
            if found is None:
                raise DamagedLog(f"boundary log: the record at byte {offset} of {len(blob)} is cut short or damaged")
            step, tag, payload, offset = found
            self.put(Key(step, BACKWARD if tag % 2 else FORWARD, tag // 2), decode(payload))
            taken += 1
        return taken

    def _enforce_budget(self) -> None:
        while self.budget is not None and self.held_bytes > self.budget and self._memory:
            key = next(iter(self._memory))
            tensors = self._memory.pop(key)
            payload = encode(tensors)
            assert self.spill_dir is not None  # __init__ refuses a budget without one
            written = sealed.write_whole(self._path(key), sealed.head(MAGIC, key.step, key.tag, payload), payload,
                                         fsync=self.fsync)
            self.held_bytes -= sum(t.numel() * t.element_size() for t in tensors)
            self._spilled[key] = written
            self.spilled_total += written

    def _path(self, key: Key) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"step{key.step}-{key.kind}-mb{key.micro}.blog"
