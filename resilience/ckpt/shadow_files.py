"""What the training's ranks and the gradient shadow (``strategy=shadow``) share: files in ``/dev/shm``, their names,
and the ones written whole and sealed (the parts, the state files).

The shadow is a process beside the supervisor (``resilience/ckpt/shadow_apply.py``, started by the strategy's
``agent_service``) that holds one replica of the parameters and the optimizer and applies every step's reduced
gradients to it, as Checkmate's CPU shadow does (arXiv:2507.13522). Everything it exchanges with the ranks lies in
files named ``rbmem-<run id>-shadow-*`` (``shm_store``'s prefix and run id: the run's clean-up removes them, and a
training node's loss, ``node_memory``, does not touch them: they stand for the shadow's own node).

* **The control block** (``shadow_control.Control``, ``-shadow-ctl``): requests, answers, the step the shadow holds,
  each rank's mark of the newest step whose parts it has put.
* **The gradient ring** (``shadow_ring.GradRing``, ``-shadow-grads``): one slot per step of rank 0's reduced
  gradients, committed last.
* **The parts** (``put_parts``/``get_parts``, ``-shadow-parts-r<rank>-<k>``): each rank's own parts of the job's
  state at a step (its RNG streams and data loader's position; rank 0 also the job-wide parts, the model's buffers
  and the groups' hyperparameters after the step), ``slots + 1`` files per rank by step, each written whole beside
  its place and renamed into it, with an xxh3 sum. They are on no replica, so they live with the shadow.
* **A state file** (``write_state``/``read_state``, ``-shadow-init`` and ``-shadow-state``): a ``torch.save`` of
  parameters and optimizer with a header and a sum: rank 0's initial state for the shadow, the shadow's state for
  the ranks after a failure. ``replica_digest`` is how such a state is compared, bit for bit, with the training's.

The ranks wait for the shadow (back-pressure) before they reuse a slot or a parts file whose step the shadow may still
need: the slot of step ``k`` holds step ``k - slots`` until it is applied, and a parts file is rewritten only once
the shadow's state is past the step it holds, so the parts of the shadow's step are always there.
"""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from resilience.ckpt import sealed, shm_store
from resilience.ckpt.shm_store import PREFIX

# ---- names ------------------------------------------------------------------------------------------------------


def _name(rid: str, what: str) -> Path:
    return shm_store.SHM_DIR / f"{PREFIX}{rid}-shadow-{what}"


def ctl_path(rid: str) -> Path:
    return _name(rid, "ctl")


def ring_path(rid: str) -> Path:
    return _name(rid, "grads")


def parts_path(rid: str, rank: int, index: int) -> Path:
    return _name(rid, f"parts-r{rank}-{index}")


def init_path(rid: str) -> Path:
    return _name(rid, "init")


def dump_path(rid: str) -> Path:
    return _name(rid, "state")


# ---- the parts, and whole state files -----------------------------------------------------------------------------

PARTS_MAGIC = b"RBSPRT01"
STATE_MAGIC = b"RBSSTA01"


def put_parts(path: Path, step: int, gen: int, parts: dict[str, Any]) -> int:
    """Keep ``parts`` (plain state dicts, pickled as they are) of ``step`` at ``path``; the bytes written."""
    payload = pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
    return sealed.write_whole(path, sealed.head(PARTS_MAGIC, step, gen, payload), payload)


def get_parts(path: Path, step: int) -> tuple[dict[str, Any], int] | None:
    """The parts of ``step`` kept at ``path``, and their size in bytes; None if that file holds no intact parts of
    that step."""
    found = sealed.read(path, PARTS_MAGIC)
    if found is None or found[0] != step:
        return None
    return pickle.loads(found[2]), sealed.HEAD.size + len(found[2])


def write_state(path: Path, step: int, gen: int, state: dict[str, Any]) -> int:
    """``state`` (tensors and plain values) of ``step``, ``torch.save``d with a header and a sum; the bytes written."""
    buf = io.BytesIO()
    torch.save(state, buf)
    view = buf.getbuffer()
    try:
        return sealed.write_whole(path, sealed.head(STATE_MAGIC, step, gen, view), view)
    finally:
        del view


def read_state(path: Path) -> tuple[int, dict[str, Any], int] | None:
    """(step, state, bytes) of a state file, or None: none there, or it fails its sum."""
    found = sealed.read(path, STATE_MAGIC)
    if found is None:
        return None
    step, _, payload = found
    return step, torch.load(io.BytesIO(payload), weights_only=False), sealed.HEAD.size + len(payload)


def replica_digest(params: list[torch.Tensor], optim_state: dict[int, dict[str, Any]]) -> str:
    """SHA-256 over a replica's parameters (the optimizer's order) and the optimizer's per-parameter state: what the
    shadow and the training must hold alike, bit for bit, at the same step (the groups' hyperparameters are not in
    it: the training's have moved on to the next step's learning rate)."""
    h = hashlib.sha256()
    for i, p in enumerate(params):
        _feed(h, f"param.{i}", p)
    for i in sorted(optim_state):
        for key in sorted(optim_state[i]):
            _feed(h, f"state.{i}.{key}", optim_state[i][key])
    return h.hexdigest()


def _feed(h: Any, key: str, value: Any) -> None:
    h.update(key.encode())
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())
