"""No fault: the reference run that every recovered run is compared with, bit for bit."""

from __future__ import annotations

from typing import Any

from injectors.base import Injector


class NoFault(Injector):

    def __call__(self, phase: str, step: int) -> None:
        return None

    def _plan_detail(self, step: int) -> dict[str, Any]:
        raise AssertionError("NoFault never fires")

    def _act(self, step: int) -> None:
        raise AssertionError("NoFault never fires")
