"""What changes at the user's scale: sentences of the decision section generated from the projection's summary.

The decision section answers from runs on this machine; at thousands of GPUs the ranking can turn (a restart that
takes 3 s here takes minutes there, failures come hours apart instead of never). The projection (its scenario:
``--config scenario=``) puts each technique's measured costs at the scenario's scale; these sentences say which
leads there, by how much, whether the failure band or the Monte Carlo could turn it, and whether it is the
technique that leads on ETTR here.
"""

from __future__ import annotations

import math

import pandas as pd


def sentences(proj: pd.DataFrame | None, local_leader: str | None = None) -> list[str]:
    """The sentences, from ``projection_summary.csv`` (empty without a projection)."""
    if proj is None or proj.empty or "goodput_closed_form" not in proj:
        return []
    feasible = proj[proj["feasible"].astype(bool)].sort_values("goodput_closed_form", ascending=False)
    if feasible.empty:
        return ["At the projection's scale no technique is feasible (each one's checkpoint takes longer than the "
                "time between failures)."]
    top = feasible.iloc[0]
    where = (f"At {top['scenario']} ({int(top['gpus']):,} GPUs, a {top['ckpt_TB']:.2f} TB checkpoint, a failure "
             f"every {top['job_mtbf_h']:.2f} h)")
    ranked = ", ".join(f"{r.strategy} {r.goodput_closed_form:.3f}" for r in feasible.itertuples())
    out = [f"{where} the projection ranks by goodput: {ranked}."]
    if len(feasible) > 1:
        second = feasible.iloc[1]
        lead = top["goodput_closed_form"] - second["goodput_closed_form"]
        out.append(f"{top['strategy']} leads {second['strategy']} by {lead:.3f} of the job's time"
                   + _band(top, second) + _monte_carlo(top, second) + ".")
    if local_leader:
        here = ("the same technique that leads on ETTR on this machine" if local_leader == top["strategy"] else
                f"not {local_leader}, which leads on ETTR on this machine: the scale's restart, detection and "
                f"failure rate turn the order")
        out.append(f"{top['strategy']} is {here}.")
    return out


def _band(top: pd.Series, second: pd.Series) -> str:
    low_top, low_second = top.get("goodput_band_low"), second.get("goodput_band_low")
    if not all(isinstance(v, float) and math.isfinite(v) for v in (low_top, low_second)):
        return ""
    if low_top >= low_second:
        return f"; it still leads at the failure band's most failures ({low_top:.3f} against {low_second:.3f})"
    return (f"; at the failure band's most failures {second['strategy']} leads instead ({low_second:.3f} against "
            f"{low_top:.3f}): which one to choose depends on the failure rate")


def _monte_carlo(top: pd.Series, second: pd.Series) -> str:
    mc_top, mc_second = top.get("goodput_monte_carlo"), second.get("goodput_monte_carlo")
    if not all(isinstance(v, float) and math.isfinite(v) for v in (mc_top, mc_second)):
        return ""
    half = float(top.get("goodput_monte_carlo_ci95") or 0.0) + float(second.get("goodput_monte_carlo_ci95") or 0.0)
    if mc_top - mc_second > half:
        return f"; the Monte Carlo agrees ({mc_top:.3f} against {mc_second:.3f}, intervals apart)"
    return (f"; the Monte Carlo does not separate them ({mc_top:.3f} against {mc_second:.3f}): read them as "
            f"even")
