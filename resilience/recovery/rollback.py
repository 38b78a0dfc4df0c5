"""Rollback after silent corruption: every rank reloads the newest checkpoint taken before the first bad
fingerprint (the detector's ``rollback_to``) and replays; corrupt newer checkpoints are passed over."""

from __future__ import annotations

from resilience.caps import PolicyCaps
from resilience.recovery.base import RecoveryPolicy


class Rollback(RecoveryPolicy):
    on_silent = "rollback"
    caps = PolicyCaps(rolls_back=True)
