"""DLRover Flash Checkpoint of sharded state (``parallel=fsdp|hsdp``): its FSDP engine, handed our DTensor state.

DLRover 0.6.1's FSDP wrapper (``flash_checkpoint.fsdp.FsdpShardCheckpointer``) builds the state dict with FSDP1's
APIs (``FSDP.state_dict_type``, ``FSDP.optim_state_dict``), which a model sharded by FSDP2's ``fully_shard`` does
not have. Below the wrapper, the library's engine (``fsdp_engine.FsdpCheckpointEngine``) takes any state dict
that DCP can save. So this strategy calls the engine, not the wrapper (declared in ``result.json``'s peer
settings as ``api``): ``save_to_memory`` / ``save_to_storage`` with the ``get_state_dict`` state (``DTensor``
shards; DCP into each local rank's own segment through the library's ``SharedMemoryWriter``; the saver writes
each segment as ``__<rank>_0.distcp`` and rank 0's DCP metadata as ``.metadata``), and ``load`` for the reader
that DCP's ``load`` then reads through: the library's ``SharedMemoryReader`` where every rank's copy survived at
the same step, its ``FileReader`` otherwise. What the wrapper adds beside the FSDP1 calls (the state dict's
layout, a ``step`` key) is rebuilt here in a few lines; nothing of the library is changed.

Fingerprints: each rank's own shards (the local tensors of its ``DTensor``s, and what else its state dict holds),
gathered to rank 0, which records one CRC32 per rank. A whole-state fingerprint would need every shard on one
rank (an all-gather of the whole state inside every stall) and still check only what that rank sees; each rank
loads its own shards, so each checks exactly those, in parallel, and one all-reduce makes the verdict common, so
that no rank loads a copy that another rejected.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from resilience.ckpt.snapshot import local_part
from resilience.state.train import TrainState, map_tensors, state_crc32, tensor_bytes
from resilience.libs.dlrover_layout import RANK_IN_CONFIG, engine_view, write_back

STAGE_DIR = "._dlrover_ckpt_stage"  # the saver's ``<step>.done`` directory, removed once every shard is written


class ShardedFlash:
    """DLRover's FSDP engine for one rank: saves this rank's shards to its segment (and disk), loads them back."""

    def __init__(self, ckpt_dir: Path, timeout_s: float, patches: set[str]) -> None:
        from dlrover.python.common.storage import get_checkpoint_storage
        from dlrover.trainer.torch.flash_checkpoint import fsdp_engine

        self.ckpt_dir, self.lib, self.patches = ckpt_dir, fsdp_engine, patches
        # Local rank 0 sends the saver's class (``FsdpDcpSaver``, one shard per local rank) through the factory
        # queue that ``AsyncCheckpointSaver.start_async_saving_ckpt`` serves: in the agent or the rank's child.
        # ``save_timeout`` (the saver's commit; 600 s by default) is our wait for the saver, so that the library as
        # shipped, whose commit never completes (``rank_in_shard_config``), holds its saver no longer than we wait.
        self.engine = fsdp_engine.FsdpCheckpointEngine(str(ckpt_dir), get_checkpoint_storage(), comm_backend="gloo",
                                                       save_timeout=int(timeout_s))

    @staticmethod
    def clear(step_dir: Path) -> None:
        """Rank 0, before a persist: remove what an interrupted save of this step left, and leave the directory
        to the saver. ``FsdpDcpSaver`` empties it from shard 0's thread while the other shards' threads write
        into it as soon as it exists, so a directory that exists already can lose their files."""
        shutil.rmtree(step_dir, ignore_errors=True)

    def save(self, step: int, sd: dict[str, Any], step_dir: Path, persist: bool) -> bool:
        """Copy this rank's shards into its segment (every rank, a collective); with ``persist`` the saver then
        writes every segment to ``step_dir``. False: DLRover skipped the copy (a segment was busy)."""
        from dlrover.python.common.constants import CheckpointConstant

        paths = {CheckpointConstant.MODEL_STATES_NAME: str(step_dir)}
        view = engine_view(sd, self.patches, saving=True)
        if persist and RANK_IN_CONFIG not in self.patches:  # as the wrapper does: the copy, then the saver told
            self.engine.save_to_storage(step, view, paths)
            return self.engine.latest_step == step
        copied = bool(self.engine.save_to_memory(step, view, paths))
        if copied and RANK_IN_CONFIG in self.patches:
            self._name_rank()
        if persist:  # the copy of this step is made: the engine only waits for every rank and tells the saver
            self.engine.save_to_storage(step, view, paths)
            return self.engine.latest_step == step
        return copied

    def _name_rank(self) -> None:
        """Patch ``rank_in_shard_config``: the engine leaves ``rank`` 0 in the config its copy records, which the
        saver names each shard's done file after (``<step>.done/<rank>``): every shard writes ``0``, the saver's
        commit never counts W of them and holds its event loop for ``save_timeout``. This records the rank."""
        from dlrover.python.elastic_agent.torch.ckpt_saver import DLROVER_CKPT_CONFIG_KEY

        handler = self.engine._shm_handler
        meta = handler.metadata.get(local=True)  # what the engine has just sent
        meta[DLROVER_CKPT_CONFIG_KEY].rank = dist.get_rank()
        handler.metadata.set(meta)

    def fingerprint(self, sd: dict[str, Any]) -> list[int] | None:
        """Every rank's CRC32 of its own shards, on rank 0 (None elsewhere)."""
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(local_crc32(sd), gathered, dst=0)
        return gathered

    def matches(self, expected: Any, sd: dict[str, Any]) -> bool:
        return isinstance(expected, list) and expected[dist.get_rank()] == local_crc32(sd)

    @staticmethod
    def agree(ok: bool) -> bool:
        """Whether every rank found its shards good."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def memory_held(self) -> bool:
        """Whether every rank's segment holds a copy (the load then tries it; a collective)."""
        return self.agree(not self.engine._shm_handler.no_checkpoint_state())

    def load(self, state: TrainState, resume: Path) -> tuple[str, dict[str, Any]] | None:
        """The library's choice (memory where every rank holds the same step, else ``resume``), read by DCP into
        a copy of the state: the live state is written only once the copy is verified. None: neither exists."""
        # Never an empty ``resume``: the library would read its tracker file, which shard 0's thread writes before
        # the other shards are on disk; only a checkpoint our commit record covers is read from disk.
        reader = self.engine.load(str(resume))
        if reader is None:
            return None
        source = "memory" if isinstance(reader, self.lib.SharedMemoryReader) else "disk"
        return source, self._read(state, reader)

    def load_disk(self, state: TrainState, path: Path) -> dict[str, Any]:
        """``path`` through the library's ``FileReader`` (the memory copy was passed over)."""
        return self._read(state, self.lib.FileReader(str(path)))

    def _read(self, state: TrainState, reader) -> dict[str, Any]:
        sd = {**map_tensors(torch.Tensor.clone, state.state_dict()), "step": 0}
        view = engine_view(sd, self.patches, saving=False)
        dcp.load(view, storage_reader=reader)
        write_back(sd, view, self.patches)
        return sd

    @staticmethod
    def loaded_bytes(sd: dict[str, Any]) -> int:
        return tensor_bytes(map_tensors(local_part, sd))

    def persisted(self, step: int, tracked: int | None) -> bool:
        """The saver wrote every shard of ``step``: its commit names the step in the tracker and then removes the
        stage directory (shard 0's thread names it earlier, before the other shards are written)."""
        return tracked == step and not (self.ckpt_dir / STAGE_DIR / f"{step}.done").exists()

    @staticmethod
    def check_written(step_dir: Path) -> None:
        """Rank 0, before the commit: every file that the saved ``.metadata`` points into is there, long enough."""
        with (step_dir / ".metadata").open("rb") as f:
            metadata = pickle.load(f)
        need: dict[str, int] = {}
        for info in metadata.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(need.items()):
            path = step_dir / name
            if not path.is_file() or path.stat().st_size < size:
                raise RuntimeError(f"DLRover's saver reported {step_dir.name} persisted, but {name} "
                                   f"{'is missing' if not path.is_file() else 'is short'} (needs {size} bytes)")

    @property
    def memory(self):
        """This rank's segment (what a node's loss takes)."""
        return self.engine._shm_handler

    def close(self) -> None:
        try:
            self.engine.close()
        except BufferError:  # a failed read's frames still hold views of the segment: the exit unmaps it
            pass


def local_crc32(sd: dict[str, Any]) -> int:
    """CRC32 of what this rank holds of ``sd``: each ``DTensor``'s local shard, every other leaf as it is."""
    return state_crc32(map_tensors(local_part, sd))
