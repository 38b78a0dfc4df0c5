"""What a survivor of a failure writes under just-in-time checkpointing (``strategy=jit``): its replica's shard of the
last completed step (``jit_files``), without a collective (the group is broken), committed with this project's commit
record (``commit.CheckpointDir``) once the step's set of shards is whole.

Several survivors with the same shard at the same step: the first to claim it (an exclusive file beside the
checkpoints) writes it, the others wait for it (and write it themselves if it does not come). Under HSDP each
survivor writes its own shard, and whoever completes the set commits it. Survivors one step apart each write their
own step; the restart loads the newest complete one (``jit_load``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from resilience.ckpt.checksum import SIDECAR_PREFIX
from resilience.ckpt.commit import COMMIT_MARKER, CheckpointDir
from resilience.ckpt.jit_files import shard_name, write_shard
from resilience.ckpt.snapshot import local_part
from resilience.record.fsio import fsync_dir
from resilience.runtime.rank import RankRuntime
from resilience.state.train import TrainState, map_tensors

WAIT_POLL_S = 0.02  # a survivor waiting for the shard another one claimed looks this often


class JitWriter:
    """This survivor's write of a step at a failure: claim its shard, write it, commit the step once it is whole."""

    def __init__(self, rt: RankRuntime, dirs: CheckpointDir, keep: int, wait_s: float) -> None:
        # wait_s: how long a survivor waits for the shard another one claimed (what is left of the grace period)
        self.rt, self.dirs, self.keep, self.wait_s = rt, dirs, keep, wait_s

    def write(self, state: TrainState, position: int, loaded: int, held: tuple[int, int], error: BaseException,
              t0: float) -> None:
        """Write this replica's shard of ``position`` (``held``: which shard, of how many; nothing if it trained
        nothing since ``loaded``), commit the step if its shards are whole, and say so (``jit_saved``, with the
        collective's ``error``; ``t0``: when the write began)."""
        rt = self.rt
        if position <= loaded:
            rt.events.emit("jit_unsaved", step=position, reason=f"nothing trained since step {loaded} was "
                           f"{'loaded' if loaded else 'the start'}", fsync=True)
            return
        shard, shards = held
        step_dir = self.dirs.path_for(position)
        final = step_dir / shard_name(shard, shards)
        if not self._claim(position, shard):
            waited = self._wait_for(final, self.wait_s)
            if waited:
                rt.events.emit("jit_unsaved", step=position, reason="another survivor wrote this step's shard",
                               fsync=True)
                return
        staging = rt.ckpt_dir / f".jit-r{rt.rank}-a{rt.attempt}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            tmp = staging / final.name
            from resilience.ckpt.dcp_files import ChecksumFileSystem  # on a rank only (dcp_files: why)

            fs = ChecksumFileSystem(rt.ckpt_fs)
            with fs.create_stream(tmp, "wb") as stream:
                nbytes = write_shard(stream, self._replica_state(state))
                stream.flush()
                os.fsync(stream.fileno())
            fs.write_sidecar(staging, shard)
            step_dir.mkdir(parents=True, exist_ok=True)
            sidecar = staging / f"{SIDECAR_PREFIX}rank{shard}.json"
            os.replace(sidecar, step_dir / sidecar.name)
            try:
                os.link(tmp, final)  # never over another survivor's: the first complete shard stays
            except FileExistsError:
                pass
            fsync_dir(step_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        committed = self._commit_if_whole(position, shards)
        rt.events.emit("jit_saved", step=position, bytes=nbytes, duration_s=time.monotonic() - t0, shard=shard,
                       shards=shards, path=str(step_dir), committed=committed,
                       error=f"{type(error).__name__}: {error}"[:300], fsync=True)
        if committed:
            for pruned in self.dirs.prune(self.keep):
                rt.events.emit("ckpt_pruned", step=pruned)
        print(f"[rank {rt.rank} attempt {rt.attempt}] a collective failed: wrote the state of step {position} "
              f"({nbytes / 1e6:.1f} MB) in {time.monotonic() - t0:.3f} s", flush=True)

    def _replica_state(self, state: TrainState) -> dict[str, Any]:
        """Model and optimizer as they stand (the last completed step's: the failed step applied nothing), and the
        job-wide parts; a rank's own parts stay in its node's memory (the live ones are the failed step's)."""
        sd = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict(),
              **state.parts.state_dict(list(state.parts.job))}
        return map_tensors(local_part, sd)

    def _claim(self, step: int, what: int | str) -> bool:
        """Whether this survivor is the first to claim ``what`` of ``step`` (a shard to write, or the commit): an
        exclusive file on the shared disk."""
        claims = self.rt.ckpt_dir / ".jit-claims"
        claims.mkdir(parents=True, exist_ok=True)
        try:
            # the attempt in the name: survivors of one failure share it, a later timeline at the same step does not
            name = f"step_{step:08d}-attempt{self.rt.attempt}-{what}"
            fd = os.open(claims / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.write(fd, f"{self.rt.rank} {os.getpid()}\n".encode())
        os.close(fd)
        return True

    @staticmethod
    def _wait_for(path: Path, seconds: float) -> bool:
        deadline = time.monotonic() + max(0.0, seconds)
        while not path.exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(WAIT_POLL_S)
        return True

    def _commit_if_whole(self, step: int, shards: int) -> bool:
        """Commit the checkpoint of ``step`` once all its shards are there: whoever sees the set complete first (each
        writer looks after linking its own shard, so the last one to link sees it); True once committed."""
        step_dir = self.dirs.path_for(step)
        if (step_dir / COMMIT_MARKER).exists():
            return True
        if any(not (step_dir / shard_name(k, shards)).exists() for k in range(shards)):
            return False
        if self._claim(step, "commit"):  # one committer: a second would list the first one's record as a file
            self.dirs.commit(step)
            fsync_dir(self.rt.ckpt_dir)
        return (step_dir / COMMIT_MARKER).exists()
