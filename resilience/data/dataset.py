"""The samples: fixed windows of the token file, each carrying its own id so that a wrong batch is caught."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from resilience.settings.checks import require_int


class TokenWindows(Dataset):
    """``samples`` items; item ``i`` is ``(i, x, y)``: the ``seq_len + 1`` tokens at offset ``i * seq_len`` (wrapping
    round the file's end), ``x`` all but the last, ``y`` all but the first, every tensor int64."""

    def __init__(self, path: str | Path, seq_len: int, samples: int) -> None:
        self.path = Path(path)
        self.seq_len = require_int("data.seq_len", seq_len, 1)
        self.samples = require_int("data.samples", samples, 1)
        if not self.path.is_file():
            raise ValueError(f"data.path={self.path}: no such file (python -m resilience.data.prepare builds one)")
        self.size = self.path.stat().st_size
        if self.size < seq_len + 1:
            raise ValueError(f"data.seq_len={seq_len}: a window needs seq_len + 1 tokens and {self.path} holds "
                             f"{self.size}")
        self._tokens: np.memmap | None = None  # mapped on first use: in the process (worker) that reads

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.samples:
            raise IndexError(f"sample {i} out of range [0, {self.samples})")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = i * self.seq_len
        window = torch.from_numpy(np.take(self._tokens, np.arange(start, start + self.seq_len + 1), mode="wrap"))
        window = window.to(torch.int64)
        return torch.tensor(i, dtype=torch.int64), window[:-1], window[1:]

    def __getstate__(self) -> dict:
        # a worker started by spawn or forkserver receives the dataset pickled: it maps the file itself
        return {**self.__dict__, "_tokens": None}
