"""Restart all ranks: tear the whole group down, start it again, resume from the newest good checkpoint.

What torchrun's elastic agent does by default, and what most large jobs do today (a failed node is replaced,
every rank reloads). The supervisor's elastic agent carries it out.
"""

from __future__ import annotations

from resilience.recovery.base import RecoveryPolicy


class RestartAll(RecoveryPolicy):
    """Silent corruption is recorded and training goes on; crashes and hangs restart every rank."""
