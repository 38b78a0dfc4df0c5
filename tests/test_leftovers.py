"""What the run's ended processes leave in /dev/shm is removed at the end of the run, and nothing else."""

from __future__ import annotations

import os

from resilience.proc.orphans import remove_torch_segments


def test_only_torch_segments_of_the_runs_processes_are_removed(tmp_path):
    ours, other = 4_000_001, 4_000_002
    names = [f"torch_{ours}_1234_0", f"torch_{ours}_1234_1", f"torch_{other}_99_0", f"rbmem-{ours}",
             f"torch_{ours}x_1_0", "torch_shm_manager"]
    for name in names:
        (tmp_path / name).write_bytes(b"x" * 10)
    removed = remove_torch_segments({ours, os.getpid()}, shm_dir=tmp_path)
    assert sorted(removed) == [(f"torch_{ours}_1234_0", 10), (f"torch_{ours}_1234_1", 10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
