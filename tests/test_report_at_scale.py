"""The decision section's sentences about the projection's scale come from the projection's summary: change the
figures and the sentences change (reports/at_scale.py)."""

from __future__ import annotations

import pandas as pd

from reports import at_scale


def summary(**goodput: tuple[float, float, float, float]) -> pd.DataFrame:
    """strategy -> (closed form, band low, Monte Carlo, its 95% half-width)."""
    return pd.DataFrame([{"scenario": "llama3_405b", "strategy": name, "gpus": 16384, "ckpt_TB": 5.265,
                          "job_mtbf_h": 3.09, "feasible": True, "goodput_closed_form": g, "goodput_band_low": low,
                          "goodput_monte_carlo": mc, "goodput_monte_carlo_ci95": half}
                         for name, (g, low, mc, half) in goodput.items()])


def test_the_leader_at_scale_its_lead_and_what_could_turn_it():
    said = " ".join(at_scale.sentences(summary(inmemory=(0.95, 0.70, 0.949, 0.001), sync=(0.86, 0.57, 0.857, 0.001)),
                                       local_leader="sync"))
    assert "llama3_405b (16,384 GPUs" in said and "inmemory 0.950, sync 0.860" in said
    assert "inmemory leads sync by 0.090" in said and "still leads at the failure band's most failures" in said
    assert "the Monte Carlo agrees" in said and "not sync, which leads on ETTR on this machine" in said


def test_the_sentences_change_with_the_figures():
    turned = " ".join(at_scale.sentences(summary(inmemory=(0.95, 0.50, 0.9500, 0.002),
                                                 sync=(0.949, 0.57, 0.9495, 0.002)), local_leader="inmemory"))
    assert "at the failure band's most failures sync leads instead" in turned
    assert "the Monte Carlo does not separate them" in turned and "the same technique that leads on ETTR" in turned
    assert at_scale.sentences(None) == []
    infeasible = summary(sync=(0.9, 0.5, 0.9, 0.01)).assign(feasible=False)
    assert "no technique is feasible" in at_scale.sentences(infeasible)[0]
