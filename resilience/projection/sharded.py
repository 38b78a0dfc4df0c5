"""Per-shard checkpoint costs from sharded runs (``parallel=fsdp|hsdp``, docs/sharded.md).

Under FSDP or HSDP every rank of a replica writes (and reads back) only its shard, so a checkpoint's cost follows
the bytes of one shard, not of the whole state: ``seconds = a + b * bytes_per_shard`` with ``bytes_per_shard =
ckpt_bytes / shards_per_replica`` (result.json's ``parallel.shards_per_replica``; HSDP's replicas hold copies that
DCP writes once). ``measured.fit_strategies`` fits this line per strategy and component (it takes a sharded run's
shard count as its writer count); :func:`per_shard_fit` states the same fits with their inputs. A projection at
1k-100k GPUs then charges each writer one shard at the measured per-shard bandwidth. A replica recovery moves one
shard too: its load is the same line at one shard's bytes.

Runs after ``recovery=shrink`` are left out of both: their saves mix two shard counts and their load is resharded.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from resilience.projection.cost_model import fit_component

SHARDS_COLUMN = "parallel.shards_per_replica"
PARALLEL_COLUMN = "parallel.name"
# component -> the column of seconds it is fitted on (as measured.fit_strategies fits it)
COMPONENTS = {"save": "ckpt_stall_s", "durable": "ckpt_durable_s", "load": "recovery_breakdown_s.load"}
FIT_COLUMNS = ("strategy", "component", "column", "n", "noisy_n", "shard_counts", "MB_per_shard", "fixed_s",
               "s_per_GB", "GBps_per_shard", "residual_range")


def shards(measured: pd.DataFrame) -> pd.Series:
    """Per row: the shards one replica holds the state in, for sharded rows; NaN for DDP and older rows."""
    if SHARDS_COLUMN not in measured or PARALLEL_COLUMN not in measured:
        return pd.Series(np.nan, index=measured.index)
    count = pd.to_numeric(measured[SHARDS_COLUMN], errors="coerce")
    return count.where(measured[PARALLEL_COLUMN].astype(str).isin(("fsdp", "hsdp")) & (count >= 1))


def resized(measured: pd.DataFrame) -> pd.Series:
    """Per row: the run changed its world size (``recovery=shrink``), so no one shard count describes it."""
    return measured.get("cell.recovery", pd.Series("", index=measured.index)).astype(str) == "shrink"


def sharded_samples(measured: pd.DataFrame) -> pd.DataFrame:
    """The rows the fit uses: sharded and not resized, with their shard count and bytes per shard."""
    count = shards(measured)
    keep = count.notna() & ~resized(measured)
    rows = measured[keep]
    return rows.assign(shards=count[keep], bytes_per_shard=pd.to_numeric(rows.get("ckpt_bytes"), errors="coerce")
                       / count[keep])


def per_shard_fit(measured: pd.DataFrame) -> pd.DataFrame:
    """One row per strategy and component with samples: ``seconds = fixed_s + s_per_GB * GB_per_shard`` and its
    inputs (n, how many noisy, the shard counts and MB per shard measured, observed/fitted). Empty without sharded
    rows."""
    rows = sharded_samples(measured)
    out = []
    for strategy, group in (rows.groupby("strategy", sort=True) if "strategy" in rows and len(rows) else ()):
        for component, column in COMPONENTS.items():
            if column in group:
                out += _fit_row(str(strategy), component, column, group)
    return pd.DataFrame(out, columns=list(FIT_COLUMNS))


def _fit_row(strategy: str, component: str, column: str, rows: pd.DataFrame) -> list[dict]:
    y = pd.to_numeric(rows[column], errors="coerce")
    ok = y.notna() & rows["bytes_per_shard"].notna() & (y >= 0) & (rows["bytes_per_shard"] > 0)
    if not ok.any():
        return []
    x = rows.loc[ok, "bytes_per_shard"].to_numpy(float)
    cost = fit_component(x, y[ok].to_numpy(float), storage_bound=True)
    res = cost.residuals
    verdict = rows.loc[ok].get("validity.verdict", pd.Series(dtype=object)).astype(str)
    return [{
        "strategy": strategy, "component": component, "column": column, "n": int(ok.sum()),
        "noisy_n": int((verdict == "noisy").sum()),
        "shard_counts": ", ".join(str(int(s)) for s in sorted(rows.loc[ok, "shards"].unique())),
        "MB_per_shard": ", ".join(f"{v / 1e6:.0f}" for v in sorted(set(np.round(x, -5)))),
        "fixed_s": cost.fixed_s,
        "s_per_GB": 1e9 / cost.per_writer_Bps if cost.per_writer_Bps else 0.0,
        "GBps_per_shard": cost.per_writer_Bps / 1e9 if cost.per_writer_Bps else None,
        "residual_range": f"{min(res):.2f}-{max(res):.2f}" if res else "-",
    }]
