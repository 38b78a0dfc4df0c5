"""A recommendation model in the style of DLRM (Naumov et al., 2019): large sparse embedding tables, small dense MLPs.

Its training state is dominated by the embedding tables and their optimizer state, which is what makes
checkpointing recommendation models expensive (Check-N-Run, NSDI'22; CPR, MLSys'21): with the default
``dlrm_emb`` settings the state is ~1.1 GB per replica while a step touches only a few thousand rows.

* Embeddings use ``sparse=True``: their gradients are sparse COO tensors, which DDP all-reduces over gloo
  (an all-gather of indices and values) and the optimizer applies row by row.
* One ``torch.optim.Adagrad`` covers every parameter. Adagrad is the usual optimizer for embedding tables
  (TorchRec/FBGEMM default to row-wise Adagrad), accepts sparse and dense gradients alike, and creates its state
  eagerly in its constructor. That last point matters for checkpointing: DCP's ``get_state_dict`` initialises
  an empty optimizer state with a dense zero-gradient step, which SparseAdam rejects and which would allocate a
  dense gradient per table; with Adagrad the plain ``TrainState`` works unchanged.
* Click labels are a pure function of (seed, step, rank): a hidden logit (a hash of each feature id, plus a
  linear function of the dense features) passed through a seeded Bernoulli draw. Feature ids follow a
  power law, as real categorical features do, so hot rows recur and the loss falls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from resilience.caps import WorkloadCaps
from resilience.settings.checks import require_int
from resilience.workloads.base import Workload, stream_seed

_MASK31 = (1 << 31) - 1


def id_hash(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """A value in [-1, 1) per id: a fixed integer hash, vectorised; products stay below 2**63 (no overflow)."""
    x = (ids * 40503 + salt) & _MASK31
    x = (((x >> 15) ^ x) * 2246822519) & _MASK31
    x = (((x >> 13) ^ x) * 3266489917) & _MASK31
    x = (x >> 16) ^ x
    return x.to(torch.float32) / float(1 << 30) - 1.0


class DLRM(nn.Module):
    """Bottom MLP on dense features, one embedding per sparse feature, pairwise dot interactions, top MLP."""

    def __init__(self, tables: int, rows: int, dim: int, dense_in: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(rows, dim, sparse=True) for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense_in, hidden), nn.ReLU(), nn.Linear(hidden, dim), nn.ReLU())
        features = tables + 1
        # a plain attribute, not state: a replica's heal does not carry it, so it is made on CPU (as an initialised
        # build makes it) even where the model is built on the meta device (resilience.state.uninitialised)
        self._pairs = torch.triu_indices(features, features, offset=1, device="cpu")
        self.top = nn.Sequential(nn.Linear(dim + features * (features - 1) // 2, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        feats = torch.stack([x] + [emb(ids[:, t]) for t, emb in enumerate(self.emb)], dim=1)  # (B, F, dim)
        inter = torch.bmm(feats, feats.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([x, inter], dim=1)).squeeze(1)


class DLRMWorkload(Workload):
    """Click-through prediction (BCE) on a synthetic, learnable, seed-determined stream."""

    caps = WorkloadCaps(sparse_gradients=True)  # its embedding tables (sparse=True)

    def __init__(self, seed: int, tables: int = 8, rows: int = 550_000, dim: int = 32,
                 dense_in: int = 13, hidden: int = 64, batch_size: int = 512, lr: float = 0.05,
                 zipf_power: float = 5.0, init_std: float = 0.01) -> None:
        super().__init__(seed)
        for field, value in (("tables", tables), ("rows", rows), ("dim", dim), ("dense_in", dense_in),
                             ("hidden", hidden), ("batch_size", batch_size)):
            require_int(f"workload.{field}", value, 1)
        if rows >= 1 << 31:
            raise ValueError(f"workload.rows={rows}: must be below 2**31")
        for field, value in (("lr", lr), ("zipf_power", zipf_power), ("init_std", init_std)):
            if not value > 0:
                raise ValueError(f"workload.{field}={value}: must be a number > 0")
        self.tables, self.rows, self.dim, self.dense_in, self.hidden = tables, rows, dim, dense_in, hidden
        self.batch_size, self.lr, self.zipf_power, self.init_std = batch_size, lr, zipf_power, init_std
        g = torch.Generator().manual_seed(stream_seed(seed, "teacher"))
        self._dense_w = torch.randn(dense_in, generator=g) / dense_in ** 0.5  # the hidden dense weights
        self._salts = [stream_seed(seed, "salt", t) & 0xFFFF for t in range(tables)]

    def state_bytes(self) -> int:
        """Bytes of parameters plus Adagrad state (one ``sum`` per parameter, 0-d ``step`` counters aside)."""
        return 2 * 4 * sum(p.numel() for p in self._shapes())

    def _shapes(self) -> list[torch.Tensor]:
        with torch.device("meta"):
            return list(DLRM(self.tables, self.rows, self.dim, self.dense_in, self.hidden).parameters())

    def build_model(self) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(self.seed, "init"))
            model = DLRM(self.tables, self.rows, self.dim, self.dense_in, self.hidden)
            for emb in model.emb:  # small rows: dot interactions start near zero, as in DLRM's reference
                nn.init.normal_(emb.weight, std=self.init_std)
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # foreach=False: the per-tensor reference loop; it is also the path that handles sparse gradients.
        return torch.optim.Adagrad(model.parameters(), lr=self.lr, foreach=False)

    def batch(self, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(stream_seed(self.seed, step, rank))
        n = self.batch_size
        dense = torch.randn(n, self.dense_in, generator=g)
        # Power-law ids, scattered over the table by a bijection (hashed features hit rows all over it).
        raw = (torch.rand(n, self.tables, generator=g, dtype=torch.float64) ** self.zipf_power * self.rows).long()
        ids = (raw.clamp_(max=self.rows - 1) * 1_000_003) % self.rows
        logit = dense @ self._dense_w
        for t, salt in enumerate(self._salts):
            logit = logit + 1.5 * id_hash(ids[:, t], salt)
        clicks = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return dense.to(device), ids.to(device), clicks.to(device)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        dense, ids, clicks = batch
        return F.binary_cross_entropy_with_logits(model(dense, ids), clicks)
