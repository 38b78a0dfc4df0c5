"""Incremental checkpoints of a recommendation model, after Check-N-Run (A. Eisenman, K. K. Matam, S. Ingram, D.
Mudigere, R. Krishnamoorthi, K. Nair, M. Smelyanskiy, M. Annavaram; "Check-N-Run: a Checkpointing System for
Training Deep Learning Recommendation Models", NSDI'22).

A step of an embedding model changes only the rows of its tables that the step's sparse gradients touch (a few
thousand of ``dlrm_emb``'s 4.4 million). So every ``base_every``-th checkpoint is a full *base*, and each one between
holds only the rows touched since the previous checkpoint (and those rows' optimizer state), plus everything else
whole: the dense parameters and their optimizer state, the optimizer's param groups, the job's parts (LR schedule,
RNG, data loader, counters: what ``sync`` saves). A restore loads the base and replays the chain of increments in
order (``resilience/ckpt/increments.py``: the layout), bit for bit the state of the newest link.

Which rows a step touched: the optimizer's step pre-hook reads the indices of each table's (already reduced) sparse
gradient and marks them in a boolean mask per table; a save writes the marked rows and clears the masks once every
rank wrote its share. It is exact because the rows an optimizer step changes are the indices of the sparse gradient
it applies (Adagrad, SGD and SparseAdam update only those rows of the table and of its state), the same rows the
replica fingerprint reads per step (``detectors/replica_fingerprint.py``); and cheap: one scatter of a few thousand
indices into the masks per step, where comparing the tables with the last saved copy would keep a second copy of
them (1.1 GB) and read both at every checkpoint. A save the masks cannot vouch for (the optimizer was not watched
since the previous link: a fresh start, a state it did not load) is a base. A failed save clears nothing: its rows go
into the next one.

Durability and choice as ``sync``'s: every file fsynced and summed as written, the link committed by rank 0
(``commit.CheckpointDir``: COMMIT.json renamed into place). A load takes the newest committed link whose whole chain
is there, committed, this run's, consistent (each link names its predecessors by step and id) and passes its
checksums on every rank, read once (``verified``); a missing, corrupt or rewritten link rejects every link after it
in its chain, and the load falls back to the newest complete chain (an older increment of the same chain, or an
older chain). ``checkpoint.keep``: at least this many restore points are kept, each with its whole chain.

Each rank writes the tables ``j`` with ``j % world_size == rank`` (the data-parallel replicas are equal); rank 0 the
dense state; each rank its own parts. ``ckpt_durable`` carries the bytes of the link (all ranks' files), its kind
(``link``: base or increment) and the rows it holds.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from resilience.caps import StrategyCaps
from resilience.ckpt.commit import CheckpointDir, CheckpointEntry
from resilience.ckpt.digest import for_record
from resilience.ckpt.increments import (BASE, INCREMENT, LINK_META, Link, RowMarker, TensorWriter, chain_kept,
                                        dequantize, filled, index_file, link_files, link_meta, markers_to,
                                        new_link_id, parse_meta, prune, quantize, read_index, read_meta,
                                        read_tensor, rows_file, sparse_params, split_state, synced, write_index)
from resilience.ckpt.verified import CorruptFile, read_verified
from resilience.runtime.rank import RankRuntime
from resilience.settings.checks import require_int
from resilience.state.train import TrainState
from resilience.strategies.base import CheckpointStrategy


class IncrementalCheckpoint(CheckpointStrategy):
    # its own files, each through the checkpoint file system (a disk fault reaches them); whole tables from each
    # replica, so no sharded state; a workload without sparse embedding tables is refused (resilience.compat)
    caps = StrategyCaps(family="incremental", writes_through_checkpoint_fs=True, saves_touched_rows=True,
                        sharded_refusal="it saves embedding rows of whole tables")
    bits: int | None = None  # how the rows' values are stored: None raw (exact); quantized: 8 or 16

    def __init__(self, every: int, keep: int, base_every: int = 4) -> None:
        super().__init__(every, keep)
        self.base_every = require_int("strategy.base_every", base_every, 1)
        self._optimizer: torch.optim.Optimizer | None = None  # whose steps the masks follow
        self._hook: Any = None
        self._tables: list[torch.nn.Parameter] = []
        self._masks: list[torch.Tensor] = []  # per table: the rows touched since the newest link of ``_chain``
        self._chain: list[Link] | None = None  # the chain the live state continues (None: the next save is a base)

    def attach(self, rt: RankRuntime) -> None:
        super().attach(rt)
        import resilience.ckpt.dcp_files  # noqa: F401  (its imports now, not in the first save: sync's attach)
        self.dirs = CheckpointDir(rt.ckpt_dir, owner=rt.identity)
        self._reported: set[int] = set()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---- which rows changed ----

    def _track(self, state: TrainState) -> None:
        """Follow the optimizer steps of ``state`` from now on; until a link is written or loaded, the rows changed
        before are unknown, so the next save is a base."""
        if state.optimizer is self._optimizer:
            return
        self.close()
        self._optimizer = state.optimizer
        self._tables = sparse_params(state.model)
        self._masks = [torch.zeros(p.shape[0], dtype=torch.bool, device=p.device) for p in self._tables]
        self._hook = state.optimizer.register_step_pre_hook(self._touched)
        self._chain = None

    def _touched(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before each optimizer step: mark the rows its sparse gradients will change (a dense gradient on a table,
        which no sparse embedding makes: every row)."""
        for p, mask in zip(self._tables, self._masks):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                mask[g._indices()[0]] = True  # uncoalesced indices may repeat: marking twice is harmless
            else:
                mask.fill_(True)

    def _clear(self) -> None:
        for mask in self._masks:
            mask.zero_()

    def load(self, state: TrainState) -> int:
        self._track(state)  # before anything trains: every step of this attempt is followed
        return super().load(state)

    # ---- save ----

    def _save(self, step: int, state: TrainState) -> None:
        rt = self.rt
        if state.optimizer is not self._optimizer:
            self._track(state)
        base = self._chain is None or len(self._chain) >= self.base_every
        if rt.rank == 0:
            self.dirs.prepare(step)
        dist.barrier()  # nobody writes into the directory before rank 0 has emptied it
        path = self.dirs.path_for(step)
        link_id = new_link_id() if rt.rank == 0 else ""
        chain = [(step, link_id)] if base or not self._chain else [*self._chain, (step, link_id)]
        error, rows = None, 0
        try:
            rows = self._write(path, state, base, chain)
            rt.fault_hook("during_checkpoint", step)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        outcome: list[Any] = [None] * rt.world_size
        dist.all_gather_object(outcome, (error, link_id, rows))  # every rank learns whether all wrote their share
        errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(outcome) if e]
        if errors:
            # not committed: the link is lost, not corrupt; the masks keep this save's rows for the next one
            rt.events.emit("ckpt_failed", step=step, error="; ".join(errors)[:500], fsync=True)
            return
        chain[-1] = (step, outcome[0][1])
        self._chain = chain
        self._clear()
        if rt.rank == 0:
            nbytes = self.dirs.commit(step)
            rt.events.emit("ckpt_durable", step=step, bytes=nbytes, path=str(path), link=BASE if base else INCREMENT,
                           chain_length=len(chain), rows=sum(o[2] for o in outcome), fsync=True)
            for pruned in prune(self.dirs, chain_kept(self.dirs, chain, self.keep)):
                rt.events.emit("ckpt_pruned", step=pruned)

    def _write(self, path: Any, state: TrainState, base: bool, chain: list[Link]) -> int:
        """This rank's files of the link (rank 0's ``.metadata`` too), each fsynced and summed as written; return
        the rows it wrote."""
        from resilience.ckpt.dcp_files import ChecksumFileSystem  # on a rank only (dcp_files: why)

        rt = self.rt
        fs = ChecksumFileSystem(rt.ckpt_fs)  # over a disk fault's I/O layer, if any
        dense, own, row_tensors = split_state(state)
        index: dict[str, Any] = {"tables": {}, "dense": None, "own": own}
        written = 0
        with fs.create_stream(path / rows_file(rt.rank), "wb") as f:
            w = TensorWriter(f)
            for j, table in enumerate(self._tables):
                if j % rt.world_size != rt.rank:
                    continue
                n = table.shape[0]
                idx = None if base else torch.nonzero(self._masks[j]).squeeze(1)
                entry: dict[str, Any] = {"rows": n if idx is None else int(idx.numel()), "indices": None,
                                         "tensors": {}}
                if idx is not None:
                    entry["indices"] = w.put(idx.to(torch.int32 if n < 1 << 31 else torch.int64))
                for r in (r for r in row_tensors if r.table == j):
                    values = r.tensor if idx is None else r.tensor.index_select(0, idx)
                    codec, parts = quantize(values, self.bits if r.values else None)
                    entry["tensors"][r.key] = {"codec": codec, "dtype": str(r.tensor.dtype).removeprefix("torch."),
                                               "shape": tuple(r.tensor.shape),
                                               "parts": {k: w.put(v) for k, v in parts.items()}}
                index["tables"][j] = entry
                written += entry["rows"]
            if rt.rank == 0:
                index["dense"] = w.skeleton(dense)
            synced(f)
        with fs.create_stream(path / index_file(rt.rank), "wb") as f:
            write_index(f, index)
            synced(f)
        if rt.rank == 0:
            with fs.create_stream(path / LINK_META, "wb") as f:
                f.write(json.dumps(link_meta(BASE if base else INCREMENT, chain, rt.world_size, self.bits)).encode())
                synced(f)
        fs.write_sidecar(path, rt.rank)
        return written

    # ---- load ----

    def _load(self, state: TrainState) -> tuple[int, str, int] | None:
        while (chain := self._agreed_chain()) is not None:
            buffers = self._read_verified(chain)
            if buffers is None:
                continue
            metas = [parse_meta(link[LINK_META]) for link in buffers]
            self._restore(state, buffers, metas)
            self._chain = list(metas[-1]["chain"])
            self._clear()  # the live state is the newest link's: rows touched from here on go into the next one
            stored = sorted({m["bits"] for m in metas if m.get("bits")})
            if stored:
                self.rt.events.emit("ckpt_loaded_inexact", step=chain[-1].step,
                                    why=self.caps.inexact_restore or f"embedding rows stored with {stored} bits")
            return chain[-1].step, "disk", sum(len(b) for link in buffers for b in link.values())
        self._chain = None
        return None

    def _agreed_chain(self) -> list[CheckpointEntry] | None:
        """The chain every rank loads, oldest link first: rank 0 chooses and everyone follows."""
        choice: list[Any] = [None]
        if self.rt.rank == 0:
            chain = self._choose()
            choice = [[e.step for e in chain] if chain else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        by_step = {e.step: e for e in self.dirs.entries() if e.committed}
        return [by_step[s] for s in choice[0]]

    def _choose(self) -> list[CheckpointEntry] | None:
        """The newest committed link within the rollback bound whose whole chain passes ``_resolve``; every one
        passed over is recorded with the reason, once."""
        rt = self.rt
        newest = self.dirs.newest_committed()
        for bad in self.dirs.incomplete_after(newest.step if newest else -1):
            if bad.step not in self._reported:
                rt.events.emit("ckpt_incomplete", step=bad.step, path=str(bad.path))
                self._reported.add(bad.step)
        committed = {e.step: e for e in self.dirs.entries() if e.committed}
        for step in sorted(committed, reverse=True):
            if step in self._rejected or (rt.load_max_step is not None and step > rt.load_max_step):
                continue
            chain, reason = self._resolve(committed[step], committed)
            if reason is None:
                return chain
            self._reject(committed[step], reason)
        return None

    def _resolve(self, entry: CheckpointEntry,
                 committed: dict[int, CheckpointEntry]) -> tuple[list[CheckpointEntry], str | None]:
        """``entry``'s chain, oldest first, or why it cannot be loaded: its own check (this run's, files present
        with their sizes), then every earlier link there, committed, not rejected, and the one it names (its own
        metadata lists the same chain up to itself)."""
        reason = self.dirs.check(entry, checksums=False)  # the checksums are left to the load, which reads once
        if reason is not None:
            return [], reason
        try:
            links = read_meta(entry)["chain"]
        except (OSError, ValueError, KeyError) as exc:
            return [], f"unreadable link metadata: {type(exc).__name__}: {exc}"[:300]
        if links[-1][0] != entry.step:
            return [], f"its link metadata is for step {links[-1][0]}"
        found = []
        for i, (step, _) in enumerate(links[:-1]):
            link = committed.get(step)
            if step in self._rejected:
                return [], f"link step {step} of its chain was rejected"
            if link is None:
                return [], f"link step {step} of its chain is missing or uncommitted"
            why = self.dirs.check(link, checksums=False)
            if why is not None:
                return [], f"link step {step} of its chain: {why}"
            try:
                named = read_meta(link)["chain"]
            except (OSError, ValueError, KeyError) as exc:
                return [], f"link step {step} of its chain: unreadable link metadata ({type(exc).__name__})"
            if named != links[:i + 1]:
                return [], f"link step {step} of its chain was written anew by another save"
            found.append(link)
        return [*found, entry], None

    def _read_verified(self, chain: list[CheckpointEntry]) -> list[dict[str, memoryview]] | None:
        """Every file of every link of ``chain``, in memory, each checked against its checksum and the chain's
        links against each other, or None when any rank found one bad (rank 0 then rejects the newest bad link;
        the next ``_agreed_chain`` passes over every chain that names a rejected link). No rank fails alone and no
        tensor is touched before all agree."""
        records = [self.dirs.manifest(e) for e in chain] if self.rt.rank == 0 else None
        shared = [records]
        dist.broadcast_object_list(shared, src=0)  # what rank 0 checked is what every rank verifies
        records = shared[0]
        fs = self.rt.ckpt_fs  # None: plain files, mapped
        out: list[dict[str, memoryview]] = []
        bad: tuple[int, str] | None = None
        expected: list[Link] = []
        for entry, record in reversed(list(zip(chain, records))):  # the newest first: its chain is the one to hold
            try:
                digest, sums = for_record(record)
                link = {name: read_verified(fs, entry.path / name, size, sums[name], digest)
                        for name, size in record["files"].items()}
                meta = parse_meta(link[LINK_META])
                lacking = sorted(set(link_files(meta["world_size"])) - set(link))
                if lacking:
                    raise ValueError(f"the link lacks {', '.join(lacking)}")
                expected = expected or meta["chain"]
                if meta["chain"] != expected[:len(meta["chain"])] or meta["chain"][-1][0] != entry.step:
                    raise ValueError("its link metadata does not continue the chain")
                out.insert(0, link)
            except (OSError, KeyError, ValueError) as exc:
                why = str(exc) if isinstance(exc, CorruptFile) else f"{type(exc).__name__}: {exc}"[:300]
                bad = (entry.step, why)
                break
        reasons: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(reasons, bad)
        found = [(r, b) for r, b in enumerate(reasons) if b]
        if not found:
            self.rt.events.emit("ckpt_read_verified", step=chain[-1].step, files=sum(len(x) for x in out),
                                of_files=sum(len(r["files"]) for r in records),
                                bytes=sum(len(b) for x in out for b in x.values()), links=len(chain))
            return out
        if self.rt.rank == 0:
            newest = max(b[0] for _, b in found)
            entry = next(e for e in chain if e.step == newest)
            self._reject(entry, "; ".join(f"rank {r}: {b[1]}" for r, b in found if b[0] == newest))
        return None

    def _restore(self, state: TrainState, buffers: list[dict[str, memoryview]], metas: list[dict]) -> None:
        """The base's rows, each increment's rows in order, then the newest link's dense state and this rank's own
        parts, into ``state``: the live tensors are written in place where they exist."""
        _, _, rows = split_state(state)
        live = {r.key: r.tensor for r in rows}
        targets: dict[str, torch.Tensor] = {}
        for i, (link, meta) in enumerate(zip(buffers, metas)):
            for rank in range(meta["world_size"]):
                index, data = read_index(link[index_file(rank)]), link[rows_file(rank)]
                for table in index["tables"].values():
                    self._apply_rows(table, data, i == 0, live, targets)
        if set(live) - set(targets):
            raise ValueError(f"the chain lacks the rows of {sorted(set(live) - set(targets))[:3]}")
        last, meta = buffers[-1], metas[-1]
        dense = filled(read_index(last[index_file(0)])["dense"], last[rows_file(0)])
        model_rows = {k for k, v in dense["model"].items() if isinstance(v, RowMarker)}
        for k in model_rows:  # the model's tables were written in place
            if targets[f"model/{k}"] is not live[f"model/{k}"]:
                raise ValueError(f"{k}: the stored table does not fit the model's")
        result = state.model.load_state_dict({k: v for k, v in dense["model"].items() if k not in model_rows},
                                             strict=False)
        if result.unexpected_keys or set(result.missing_keys) != model_rows:
            raise ValueError(f"the stored model does not fit: missing {result.missing_keys[:3]}, unexpected "
                             f"{result.unexpected_keys[:3]}")
        state.optimizer.load_state_dict(markers_to(dense["optim"], targets))  # adopts the tensors (no copy)
        own = read_index(last[index_file(self.rt.rank)])["own"] if self.rt.rank < meta["world_size"] else {}
        state.parts.load_state_dict({**{k: v for k, v in dense.items() if k not in ("model", "optim")}, **own})

    @staticmethod
    def _apply_rows(table: dict, data: memoryview, base: bool, live: dict[str, torch.Tensor],
                    targets: dict[str, torch.Tensor]) -> None:
        """One table's stored rows into ``targets`` (the live tensors, or new ones where the optimizer has no state
        yet): the whole table from the base, the listed rows from an increment."""
        if (table["indices"] is None) != base:
            raise ValueError("a base holds whole tables, an increment listed rows")
        idx = None if base else read_tensor(data, table["indices"]).long()
        for key, t in table["tensors"].items():
            dtype = getattr(torch, t["dtype"])
            dst = targets.get(key)
            if dst is None:
                if not base:
                    raise ValueError(f"{key}: in an increment, not in its base")
                dst = live.get(key)
                if dst is None or dst.dtype != dtype or tuple(dst.shape) != tuple(t["shape"]):
                    dst = torch.empty(t["shape"], dtype=dtype)
                targets[key] = dst
            if base and t["codec"] == "raw" and dst.device.type == "cpu":
                read_tensor(data, t["parts"]["values"], into=dst)  # straight from the file into the tensor
                continue
            parts = {k: read_tensor(data, ref) for k, ref in t["parts"].items()}
            values = dequantize(t["codec"], parts, dtype).to(dst.device)
            if idx is None:
                dst.copy_(values.reshape(dst.shape))
            else:
                dst.index_copy_(0, idx.to(dst.device), values)
