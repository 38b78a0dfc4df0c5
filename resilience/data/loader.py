"""The rank's batches from a map-style dataset, through torchdata's ``StatefulDataLoader``, as a checkpointable
Stateful: a fresh loader given ``state_dict()`` yields exactly the batches the original would have yielded next.

The state is the epoch (ours: ``DistributedSampler`` keeps its epoch out of any state, meta-pytorch/data#1513) and
the loader's own state (where in the epoch, the workers' seeds). The sampler's epoch is set before the loader builds
its iterator, after a load too, because torchdata replays the sampler up to the saved position and the order it
replays is the epoch's. Checked on torchdata 0.11.0 with torch 2.13.0 (tests/test_data.py): a state saved mid-epoch,
at an epoch's last batch or just after the rollover resumes exactly, so no workaround is applied; the epoch-end bug
of meta-pytorch/data#1437 does not occur there, and #1453 is in ``torchdata.nodes.Loader``, not used here.

The workers start from a fork server and end with the rank: ``resilience.data.workers`` says why (measured).
"""

from __future__ import annotations

import copy
import importlib
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from resilience.data.workers import START_METHOD, START_METHODS, context, die_with_rank
from resilience.settings.checks import require_bool, require_choice, require_int

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

FORMAT = 1  # of the state_dict: a state of another format is refused, not misread


class LoaderData:
    """The batches ``(ids, x, y)`` that rank ``rank`` of ``world_size`` trains on, epoch after epoch."""

    def __init__(self, dataset: Dataset, rank: int, world_size: int, batch_size: int, seed: int = 0,
                 shuffle: bool = True, num_workers: int = 2, start_method: str = START_METHOD) -> None:
        require_int("world_size", world_size, 1)
        require_int("rank", rank, 0, world_size - 1)
        require_int("data.batch_size", batch_size, 1)
        require_int("data.seed", seed, 0)
        require_bool("data.shuffle", shuffle)
        require_int("data.num_workers", num_workers, 0)
        require_choice("data.start_method", start_method, START_METHODS)
        # What a saved state is only valid for: the same sampler and the same worker count (each worker's share).
        self.layout = {"rank": rank, "world_size": world_size, "batch_size": batch_size, "seed": seed,
                       "shuffle": shuffle, "num_workers": num_workers, "samples": len(dataset)}
        # drop_last in the sampler and the loader: every rank takes the same number of full batches per epoch, so
        # that no rank waits in a collective for a batch another rank does not have.
        loader_class = _stateful_dataloader()
        self._sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                           drop_last=True)
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: a warning per loader, nothing to act on
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            self._loader: StatefulDataLoader | None = loader_class(
                dataset, batch_size=batch_size, sampler=self._sampler, num_workers=num_workers, drop_last=True,
                # the workers live as long as the loader: an epoch's rollover neither starts them again nor draws a
                # new base seed for them, which a restored loader could not redraw (its state would differ)
                persistent_workers=num_workers > 0,
                multiprocessing_context=context(start_method, type(dataset).__module__) if num_workers else None,
                worker_init_fn=die_with_rank() if num_workers else None,
                # the workers' base seed comes from this generator: without one it is drawn from torch's global
                # generator, and starting an epoch would shift the training's own random stream
                generator=torch.Generator().manual_seed(seed))
        if len(self._loader) == 0:
            raise ValueError(f"data.batch_size={batch_size}: {len(dataset)} samples over world_size={world_size} "
                             f"leave no full batch per rank; allowed: at most {len(dataset) // world_size}")
        self._epoch = 0
        self._iter: Any = None
        self._restored: dict[str, Any] | None = None  # the state loaded, until a batch is drawn after it

    @property
    def epoch(self) -> int:
        """The epoch that the next batch comes from (or the one just finished, until the next batch is drawn)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self._open())

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next batch ``(ids, x, y)`` on ``device``; past an epoch's last batch, the first of the next epoch."""
        loader = self._open()
        for _ in range(2):  # at most one rollover: a restored epoch may have nothing left, a fresh one has batches
            if self._iter is None:
                # before the loader builds its iterator: after a load, it replays the sampler to the saved position,
                # in the order of the sampler's epoch at that moment
                self._sampler.set_epoch(self._epoch)
                self._iter = iter(loader)
                self._restored = None
            try:
                ids, x, y = next(self._iter)
            except StopIteration:
                self._epoch += 1
                self._iter = None
                continue
            return ids.to(device), x.to(device), y.to(device)
        raise RuntimeError(f"epoch {self._epoch} yielded no batch")  # len(loader) > 0: not reachable

    def state_dict(self) -> dict[str, Any]:
        """Plain Python (ints, dicts, lists): picklable, and a DCP non-tensor object."""
        if self._restored is not None:
            # not yet iterated since the load: asking the loader would start its workers to restate the same state
            return copy.deepcopy(self._restored)
        loader = self._open().state_dict() if self._iter is not None else {}  # {}: the loader's own "from start"
        return {"format": FORMAT, "layout": dict(self.layout), "epoch": self._epoch, "loader": copy.deepcopy(loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state`` was taken; the next ``next_batch`` is the batch that followed it."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"data loader state: not a state of format {FORMAT} (keys: "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__})")
        if state["layout"] != self.layout:
            diff = {k: (v, self.layout.get(k)) for k, v in state["layout"].items() if self.layout.get(k) != v}
            raise ValueError(f"data loader state: saved with another layout (saved, here): {diff}; a loader "
                             f"resumes only with the rank, world size, batch size, seed, shuffle and workers it saved")
        loader = self._open()
        self._epoch = int(state["epoch"])
        self._iter = None  # the next batch builds the loader's iterator, after setting the sampler's epoch
        loader.load_state_dict(copy.deepcopy(state["loader"]))
        self._restored = copy.deepcopy(state)

    def close(self) -> None:
        """Stop the worker processes (idempotent). The iterator's finalizer joins them; it runs as soon as the last
        reference goes, and the loader and this object hold the only ones."""
        self._iter = None
        self._loader = None

    def _open(self) -> StatefulDataLoader:
        if self._loader is None:
            raise RuntimeError("LoaderData is closed")
        return self._loader

    def __enter__(self) -> LoaderData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stateful_dataloader() -> type[StatefulDataLoader]:
    # torchdata is the optional extra "data": without it, the rest of the harness still imports this module
    try:
        return importlib.import_module("torchdata.stateful_dataloader").StatefulDataLoader
    except ImportError as exc:
        raise ValueError(f"torchdata is not installed ({exc}); install the extra: pip install -e '.[data]'") from None
