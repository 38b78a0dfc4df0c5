"""Checkpoint machinery the strategies share: commit records, checksums, snapshot buffers, shared memory, transfer."""
