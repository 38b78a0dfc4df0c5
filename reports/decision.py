"""The report's first section: what to choose. Per workload, each question a team asks of the techniques the
matrix compares, answered from the runs: the technique that leads, by how much, with its interval, called only
where the 95% intervals of the medians separate (``reports.stats.difference``), beside an exact rank test's p-value;
otherwise "no difference shown at n=..." with about the n per side that would show one. Then the trade-offs, each
a sentence made from the same answers (never typed by hand).

Only techniques measured in at least ``stats.MIN_N`` timed runs (ok, not noisy) are compared: below that a median
has no 95% interval. The others are named with their n, for the tables below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations

import pandas as pd

from reports import at_scale, stats, tables

BASELINE = "none"  # the step-time question's reference: training with no checkpoint code


@dataclass(frozen=True)
class Question:
    """One question of the section: which technique has the lowest (or highest) ``metric`` over the runs of
    ``fault`` ("none": the fault-free runs). ``better`` completes "A ... than B" in a trade-off sentence."""

    key: str
    asks: str
    metric: str
    unit: str
    better: str
    fault: str = "none"
    higher_is_better: bool = False
    against_baseline: bool = False  # also every technique against training with no checkpoint (BASELINE)
    skip: tuple[str, ...] = (BASELINE,)  # techniques it does not rank (none saves no checkpoint)


def questions(frame: pd.DataFrame) -> list[Question]:
    """The questions this matrix's runs can answer: the fault-free costs, then recovery, lost work and ETTR for
    each fault that strikes in it (its label, as the matrix names it)."""
    steps = tables.col(frame, "steps").dropna()
    per_run = f"one fault in a {int(steps.median())}-step run" if len(steps) else "one fault per run"
    out = [
        Question("stall", "What does a checkpoint cost training (the stall)?", "ckpt_stall_s", "s",
                 "stalls training less per checkpoint"),
        Question("step_time", "How much slower is each step than with no checkpointing?", "step_time_s", "s",
                 "trains each step faster", against_baseline=True, skip=()),
        Question("durable", "How soon is a checkpoint durable (on disk, loadable)?", "ckpt_durable_s", "s",
                 "has its checkpoints durable sooner"),
    ]
    for fault in tables.order(frame, "cell.fault_label"):
        if fault == "none":
            continue
        out += [
            Question(f"recovery[{fault}]", f"After {fault}: how soon is training back where it was?",
                     "recovery_time_s", "s", f"is back sooner after {fault}", fault=fault),
            Question(f"lost[{fault}]", f"After {fault}: how many steps are trained again?", "lost_steps", "steps",
                     f"loses fewer steps to {fault}", fault=fault),
            Question(f"ettr[{fault}]", f"ETTR (productive share of the job's time) with {per_run} ({fault})",
                     "ettr", "", f"keeps a higher ETTR under {fault}", fault=fault, higher_is_better=True),
        ]
    return out


@dataclass
class Answer:
    """A question answered over one workload's runs."""

    question: Question
    medians: dict[str, stats.Median]  # compared techniques (n >= MIN_N), best first
    samples: dict[str, pd.Series]
    fewer: dict[str, int]  # measured in fewer runs: technique -> n
    pairs: dict[tuple[str, str], str] = field(default_factory=dict)  # (a, b) -> "better" / "worse" / no difference

    @property
    def names(self) -> list[str]:
        return list(self.medians)

    def called(self, a: str, b: str) -> str:
        """"better", "worse" or ``stats.NO_DIFFERENCE`` for a against b (both compared)."""
        if (a, b) not in self.pairs:
            said = stats.difference(self.medians[a], self.medians[b])
            low = {"lower": "better", "higher": "worse"}.get(said, said)
            if self.question.higher_is_better and low in ("better", "worse"):
                low = "worse" if low == "better" else "better"
            self.pairs[(a, b)] = low
        return self.pairs[(a, b)]

    def value(self, name: str) -> str:
        m = self.medians[name]
        unit = f" {self.question.unit}" if self.question.unit else ""
        return f"{m.median:.3g}{unit} [{m.low:.3g}, {m.high:.3g}] n={m.n}"

    def ratio(self, a: str, b: str) -> str:
        """"x0.59 [0.46, 0.68], rank test p=0.002": a's median over b's (its interval 95% unless a level is
        written)."""
        ma, mb = self.medians[a].median, self.medians[b].median
        p = stats.rank_test(self.samples[a], self.samples[b])
        text = f"x{ma / mb:.2f}" if mb else "x-"
        ends = stats.ratio_estimate(self.samples[a], self.samples[b]) if mb else None
        if ends:
            at = "" if ends.level >= stats.LEVEL else f" at {stats.level_text(ends.level)}"
            text += f" [{ends.low:.2g}, {ends.high:.2g}]{at}"
        return text + (f", rank test p={p:.2g}" if p is not None else "")

    def sentence(self) -> str:
        """The answer in one or two sentences (HTML-free text)."""
        if len(self.medians) < 2:
            only = f"only {self.names[0]} is measured in {stats.MIN_N}+ runs" if self.medians else \
                f"no technique is measured in {stats.MIN_N}+ runs"
            return f"Not compared: {only}." + self._fewer()
        lead, second = self.names[0], self.names[1]
        if self.called(lead, second) == "better":
            said = (f"{lead} leads: {self.value(lead)} against {second}'s {self.value(second)} "
                    f"({self.ratio(lead, second)}).")
        else:
            need = stats.runs_needed(self.medians[lead], self.medians[second])
            more = (f" About n={need} per side would separate them at the spread seen." if need else
                    " Their medians are too close for any practical number of runs to separate them.")
            said = (f"No difference shown between {lead} ({self.value(lead)}) and {second} ({self.value(second)}) at "
                    f"n={self.medians[lead].n}/{self.medians[second].n} ({self.ratio(lead, second)}).{more}")
        rest = [n for n in self.names[2:]]
        if rest:
            said += " Then: " + ", ".join(f"{n} {self.value(n)}" for n in rest) + "."
        return said + self._baseline() + self._fewer()

    def _baseline(self) -> str:
        if not self.question.against_baseline or BASELINE not in self.medians:
            return ""
        against = []
        for name in self.names:
            if name == BASELINE:
                continue
            verdict = self.called(name, BASELINE)
            word = {"better": "faster", "worse": "slower"}.get(verdict, "no difference shown")
            against.append(f"{name} {_short(self.ratio(name, BASELINE))}: {word}")
        return f" Against {BASELINE} (no checkpointing): " + "; ".join(against) + "."

    def _fewer(self) -> str:
        if not self.fewer:
            return ""
        listed = ", ".join(f"{n} (n={k})" for n, k in self.fewer.items())
        return f" Measured in fewer than {stats.MIN_N} runs, not compared here: {listed}."


def answer(q: Question, frame: pd.DataFrame) -> Answer:
    """Question ``q`` over ``frame`` (one workload's rows): each technique's timed runs of the question's fault."""
    ok = tables.timed_runs(frame)
    ways = tables.way(ok)
    runs = ok["cell.fault_label"] == q.fault if "cell.fault_label" in ok else pd.Series(False, index=ok.index)
    medians, samples, fewer = {}, {}, {}
    for name in tables.order(pd.DataFrame({"way": ways}), "way"):
        if name in q.skip:
            continue
        values = tables.col(ok[runs & (ways == name)], q.metric).dropna()
        if values.empty:
            continue
        m = stats.median_interval(values)
        if m.exact:
            medians[name], samples[name] = m, values
        else:
            fewer[name] = m.n
    ranked = sorted(medians, key=lambda n: -medians[n].median if q.higher_is_better else medians[n].median)
    if q.against_baseline and BASELINE in ranked:  # the reference is not a choice: it goes last
        ranked = [n for n in ranked if n != BASELINE] + [BASELINE]
    return Answer(q, {n: medians[n] for n in ranked}, {n: samples[n] for n in ranked}, fewer)


def trade_offs(answers: list[Answer], limit: int = 8) -> list[str]:
    """Sentences for pairs of techniques where each leads the other on some question, both called: "A stalls
    training less per checkpoint than B (x0.06), but B is back sooner after kill... (x0.80)"."""
    out: list[str] = []
    names = list(dict.fromkeys(n for a in answers for n in a.names if n != BASELINE))
    for x, y in combinations(names, 2):
        x_wins = [a for a in answers if x in a.medians and y in a.medians and a.called(x, y) == "better"]
        y_wins = [a for a in answers if x in a.medians and y in a.medians and a.called(y, x) == "better"]
        if x_wins and y_wins:
            first, second = x_wins[0], y_wins[0]
            out.append(f"{x} {first.question.better} than {y} ({_short(first.ratio(x, y))}), but {y} "
                       f"{second.question.better} ({_short(second.ratio(y, x))}).")
    return out[:limit] or ["No trade-off shown: no technique leads another on one question and trails it on a "
                           "second with both differences called."]


def _short(ratio: str) -> str:
    """"x0.06": a ratio's figure alone, for a sentence that names both techniques."""
    return ratio.split(" ")[0].rstrip(",")


@dataclass
class Workload:
    """The section for one workload: the questions with two or more techniques to compare, the trade-offs, and
    what was measured in too few runs to compare (question -> technique -> n)."""

    answers: list[Answer]
    trade_offs: list[str]
    uncompared: dict[str, dict[str, int]]

    def uncompared_text(self) -> str:
        if not self.uncompared:
            return ""
        listed = "; ".join(f"{asks}: " + ", ".join(f"{n} (n={k})" for n, k in few.items())
                           for asks, few in self.uncompared.items())
        return (f"Measured in fewer than {stats.MIN_N} timed runs per technique, so not compared here (their "
                f"medians and ranges are in the tables below): {listed}.")


def section_data(frame: pd.DataFrame) -> dict[str, Workload]:
    """Per workload: its answers, trade-offs and what it could not compare."""
    out = {}
    for workload in tables.order(frame, "cell.workload") or [""]:
        rows = frame[frame["cell.workload"] == workload] if workload else frame
        every = [answer(q, rows) for q in questions(rows)]
        answers = [a for a in every if len(a.medians) >= 2]
        uncompared = {a.question.asks: {**{n: m.n for n, m in a.medians.items()}, **a.fewer}
                      for a in every if len(a.medians) < 2 and (a.medians or a.fewer)}
        out[workload] = Workload(answers, trade_offs(answers), uncompared)
    return out


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """The section as CSV: one row per (workload, question), with the leader and whether it is called."""
    rows = []
    for workload, part in section_data(frame).items():
        for a in part.answers:
            lead = a.names[0] if a.names else None
            second = a.names[1] if len(a.names) > 1 else None
            rows.append({"workload": workload, "question": a.question.key, "asks": a.question.asks,
                         "leader": lead, "runner_up": second,
                         "called": bool(lead and second and a.called(lead, second) == "better"),
                         "ratio": a.ratio(lead, second) if lead and second else None, "answer": a.sentence()})
    return pd.DataFrame(rows, columns=["workload", "question", "asks", "leader", "runner_up", "called", "ratio",
                                       "answer"])


COVERS = ("Each interval is an exact 95% interval of a median over the timed runs of this pipeline run (ok, not "
          "noisy, noisy ones run again by make run; the matrix's repeats and seeds, on one host, one after "
          "another): it covers the spread between those runs and seeds, not between days or machines. A technique leads only where its interval and the next one's do not "
          "overlap; the rank test (Mann-Whitney, by permutation) is shown beside it, and a small p with "
          "overlapping intervals is not called. Techniques with fewer than 6 timed runs have no 95% interval "
          "and are not compared.")


def local_leader(parts: dict[str, Workload]) -> str | None:
    """The technique called first on an ETTR question on this machine, if one is."""
    for part in parts.values():
        for a in part.answers:
            if a.question.key.startswith("ettr[") and len(a.names) > 1 and a.called(a.names[0], a.names[1]) == \
                    "better":
                return a.names[0]
    return None


def html(frame: pd.DataFrame, projection: pd.DataFrame | None = None) -> tuple[str, pd.DataFrame]:
    """The section's body and its CSV; ``projection`` (its summary) adds what changes at the scenario's scale."""
    from reports.html import render_template

    parts = section_data(frame)
    scale = at_scale.sentences(projection, local_leader(parts))
    return render_template("decision.html.j2", workloads=parts, covers=COVERS, at_scale=scale), table(frame)
