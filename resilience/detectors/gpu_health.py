"""GPU health through NVML (pynvml, from nvidia-ml-py): ECC errors, retired pages, throttling.

Polled by the supervisor every ``every_s`` seconds. Where no GPU (or no NVML) is present it reports itself
unavailable once, as an event, and never fails the run.
"""

from __future__ import annotations

import time
from typing import Any

from resilience.detectors.base import Detection, Detector

# Throttle reasons that mean trouble (thermal or power brake), not the normal idle/boost management.
_BAD_THROTTLE = {"HwSlowdown": 0x8, "SwThermalSlowdown": 0x20, "HwThermalSlowdown": 0x40, "HwPowerBrakeSlowdown": 0x80}


class GpuHealth(Detector):

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = float(every_s)
        self._next = 0.0
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._baseline: dict[int, tuple[int, int]] = {}
        self.unavailable: str | None = None
        self._flagged: set[tuple[int, str]] = set()

    def start(self) -> str | None:
        """Initialise NVML; return why it is unavailable, or None."""
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not self._handles:
                self.unavailable = "NVML found no GPU"
            for i, h in enumerate(self._handles):
                self._baseline[i] = self._ecc(h)
        except Exception as exc:  # no driver, no library, no device: all mean the same here
            self.unavailable = f"{type(exc).__name__}: {exc}"
        return self.unavailable

    def _ecc(self, handle: Any) -> tuple[int, int]:
        n = self._nvml
        try:
            dbe = n.nvmlDeviceGetTotalEccErrors(handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
        except n.NVMLError:
            dbe = 0
        try:
            retired = len(n.nvmlDeviceGetRetiredPages(handle, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        except n.NVMLError:
            retired = 0
        return dbe, retired

    def on_poll(self, board: list[tuple[int, int, float, float]], now: float) -> list[Detection]:
        if self.unavailable or not self._handles or now < self._next:
            return []
        self._next = now + self.every_s
        found = []
        for i, h in enumerate(self._handles):
            dbe, retired = self._ecc(h)
            base_dbe, base_retired = self._baseline[i]
            issues = {}
            if dbe > base_dbe:
                issues["ecc_uncorrected"] = dbe - base_dbe
            if retired > base_retired:
                issues["retired_pages"] = retired - base_retired
            try:
                reasons = self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
                issues.update({k: True for k, bit in _BAD_THROTTLE.items() if reasons & bit})
            except self._nvml.NVMLError:
                pass
            for key, value in issues.items():
                if (i, key) not in self._flagged:
                    self._flagged.add((i, key))
                    found.append(Detection(self.name, None, f"GPU {i}: {key}", {"gpu": i, key: value,
                                                                               "t": time.time()}))
        return found
