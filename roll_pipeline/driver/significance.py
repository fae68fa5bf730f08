"""How sure a validation accuracy is, and whether it changed: pure functions over per-prompt outcomes.

A validation's unit is the prompt (its k responses are not independent), so everything here counts prompts:

* ``prompt_outcomes``: per prompt (``"<domain>/<id>"``), its tag, how many of its responses were scored correct
  and how many were scored (masked ones are not); the table ``validation/prompts_step_<N>.json`` holds it.
* ``wilson_interval``: the Wilson score interval of a proportion. For a scope (a tag, or ``all``) it is taken
  over prompts, each counting its share of correct responses: exact Wilson with one response per prompt, and
  with k > 1 wider than an interval over the k x n responses would be (which would treat a prompt's responses as
  independent draws).
* ``compare``: two validations (of one run, or of two runs on the same data), paired by prompt. A prompt is
  *solved* when at least half of its scored responses are correct (with k = 1: when it is); the exact McNemar
  test (a two-sided binomial test on the prompts solved in one validation only) gives each scope's p-value, and
  the tags' p-values are adjusted together by Holm's method, since a report looks at every tag at once. A tag
  *regressed* when its adjusted p-value is under ``alpha`` and fewer of its paired prompts are solved after.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from roll_core.rewards.scored import ScoredSample

ALL = "all"


@dataclass(frozen=True)
class PromptOutcome:
    tag: str
    correct: int
    scored: int

    @property
    def share(self) -> float:
        return self.correct / self.scored

    @property
    def solved(self) -> bool:
        return 2 * self.correct >= self.scored


def prompt_key(domain: str, prompt_id: object) -> str:
    return f"{domain}/{prompt_id}"


def prompt_outcomes(records: Iterable[ScoredSample], tag_name=str) -> dict[str, PromptOutcome]:
    """Per prompt, from its scored responses; a prompt whose responses were all masked is left out (nothing the
    policy wrote was judged). ``tag_name`` maps a tag to its name in metric names."""
    counts: dict[str, list] = {}
    for r in records:
        entry = counts.setdefault(prompt_key(r.domain, r.id), [tag_name(r.tag), 0, 0])
        if not r.masked:
            entry[1] += int(bool(r.correct))
            entry[2] += 1
    return {key: PromptOutcome(tag, c, n) for key, (tag, c, n) in counts.items() if n}


def outcomes_table(outcomes: Mapping[str, PromptOutcome]) -> dict[str, list]:
    """Columns for the per-prompt artifact (``outcomes_from_table`` reads them back)."""
    keys = sorted(outcomes)
    return {
        "prompt": keys,
        "tag": [outcomes[k].tag for k in keys],
        "correct": [outcomes[k].correct for k in keys],
        "scored": [outcomes[k].scored for k in keys],
    }


def outcomes_from_table(table: Mapping[str, list]) -> dict[str, PromptOutcome]:
    """The outcomes of a table's rows; a row with nothing scored is left out, a row with counts no validation
    gives (negative, or more correct than scored) makes the table refused."""
    try:
        rows = zip(table["prompt"], table["tag"], table["correct"], table["scored"], strict=True)
        outcomes = {}
        for k, t, c, n in rows:
            if not 0 <= int(c) <= int(n):
                raise ValueError(f"prompt {k}: {c} correct of {n} scored")
            if int(n) > 0:
                outcomes[str(k)] = PromptOutcome(str(t), int(c), int(n))
        return outcomes
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not a per-prompt outcome table ({err})") from None


def wilson_interval(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n`` (``successes`` may be fractional: a sum of
    shares); (nan, nan) when ``n`` is 0."""
    if n <= 0:
        return math.nan, math.nan
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + confidence / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At 0 and n the bound is exactly 0 (or 1); computed, it can miss by a rounding error.
    low = 0.0 if successes <= 0 else max(0.0, centre - half)
    high = 1.0 if successes >= n else min(1.0, centre + half)
    return low, high


def by_scope(outcomes: Mapping[str, PromptOutcome]) -> dict[str, list[str]]:
    """``all`` and every tag -> its prompts."""
    scopes: dict[str, list[str]] = {ALL: sorted(outcomes)}
    for key in scopes[ALL]:
        scopes.setdefault(outcomes[key].tag, []).append(key)
    return scopes


@dataclass(frozen=True)
class Interval:
    accuracy: float
    low: float
    high: float
    prompts: int


def intervals(outcomes: Mapping[str, PromptOutcome], confidence: float = 0.95) -> dict[str, Interval]:
    """Per scope: the mean of its prompts' shares correct and its Wilson interval over prompts."""
    out = {}
    for scope, keys in by_scope(outcomes).items():
        total = sum(outcomes[k].share for k in keys)
        low, high = wilson_interval(total, len(keys), confidence)
        out[scope] = Interval(total / len(keys) if keys else math.nan, low, high, len(keys))
    return out


def mcnemar_p(only_before: int, only_after: int) -> float:
    """Exact two-sided McNemar p-value from the discordant pairs (1.0 when there are none)."""
    discordant = only_before + only_after
    if discordant == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(only_before, discordant, 0.5).pvalue)


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of a family of p-values (each adjusted p-value is at most 1, and never below
    the one adjusted before it)."""
    ordered = sorted(pvalues, key=lambda k: pvalues[k])
    adjusted, running = {}, 0.0
    for rank, key in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * pvalues[key]))
        adjusted[key] = running
    return adjusted


@dataclass(frozen=True)
class Change:
    paired: int
    """Prompts judged in both validations."""
    solved_before: int
    solved_after: int
    only_before: int
    only_after: int
    p_value: float
    p_adjusted: float
    """Holm-adjusted over the tags (``all`` is its own family: p_adjusted = p_value)."""
    regressed: bool

    @property
    def difference(self) -> float:
        return (self.solved_after - self.solved_before) / self.paired if self.paired else math.nan


def compare(
    before: Mapping[str, PromptOutcome], after: Mapping[str, PromptOutcome], alpha: float = 0.05
) -> dict[str, Change]:
    """Per scope of ``after`` with prompts judged in both (a prompt's tag is taken from ``after``)."""
    counts: dict[str, tuple[int, int, int, int, int]] = {}
    for scope, keys in by_scope(after).items():
        pairs = [(before[k].solved, after[k].solved) for k in keys if k in before]
        if pairs:
            counts[scope] = (
                len(pairs),
                sum(b for b, _ in pairs),
                sum(a for _, a in pairs),
                sum(b and not a for b, a in pairs),
                sum(a and not b for b, a in pairs),
            )
    raw = {scope: mcnemar_p(c[3], c[4]) for scope, c in counts.items()}
    adjusted = holm({s: p for s, p in raw.items() if s != ALL})
    adjusted[ALL] = raw.get(ALL, math.nan)
    out = {}
    for scope, (n, sb, sa, ob, oa) in counts.items():
        p_adj = adjusted[scope]
        out[scope] = Change(n, sb, sa, ob, oa, raw[scope], p_adj, p_adj < alpha and sa < sb)
    return out


def interval_text(interval: Interval) -> str:
    return f"{interval.accuracy:.3f} [{interval.low:.3f}, {interval.high:.3f}] n={interval.prompts}"


def validation_significance(
    outcomes: Mapping[str, PromptOutcome],
    previous: Mapping[str, PromptOutcome] | None,
    alpha: float = 0.05,
    confidence: float = 0.95,
) -> tuple[dict[str, float], dict[str, str]]:
    """A validation's metrics and run tags: per scope ``val_ci/<scope>/{low,high}`` (and the tag ``val_ci/<scope>``
    as text), and against the ``previous`` validation (when there was one) ``val_change/<scope>/{difference,
    p_value,p_adjusted,regressed,paired}`` and the tag ``val_regressed``: the regressed tags, or ``none``."""
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    for scope, interval in intervals(outcomes, confidence).items():
        metrics[f"val_ci/{scope}/low"] = interval.low
        metrics[f"val_ci/{scope}/high"] = interval.high
        tags[f"val_ci/{scope}"] = interval_text(interval)
    if previous:
        changes = compare(previous, outcomes, alpha)
        for scope, change in changes.items():
            metrics |= {
                f"val_change/{scope}/difference": change.difference,
                f"val_change/{scope}/p_value": change.p_value,
                f"val_change/{scope}/p_adjusted": change.p_adjusted,
                f"val_change/{scope}/regressed": float(change.regressed),
                f"val_change/{scope}/paired": float(change.paired),
            }
        regressed = sorted(s for s, c in changes.items() if c.regressed and s != ALL)
        tags["val_regressed"] = ", ".join(regressed) or "none"
    return metrics, tags
