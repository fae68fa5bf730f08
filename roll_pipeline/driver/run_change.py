"""What a run changed: its first validation against its last, paired by prompt, per domain and per tag.

The end of `roll run` prints it and `roll report RUN` ends with it. Each scope (``all``, a domain, a tag) gets its
accuracy with the Wilson interval over prompts at both validations, and the paired change with McNemar's exact
test (roll_pipeline/driver/significance.py): the domains are one family for Holm's adjustment, the tags another,
as a reader looks at every domain at once and, apart, at every tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from roll_pipeline.driver.significance import (
    ALL,
    Change,
    Interval,
    PromptOutcome,
    compare,
    intervals,
)


def prompt_domain(key: str) -> str:
    """The domain of a prompt key (``"<domain>/<id>"``; an id may hold "/" itself, a domain never does)."""
    return key.partition("/")[0]


@dataclass(frozen=True)
class ScopeChange:
    """One row of a run's change: a scope of kind ``all``, ``domain`` or ``tag``, its accuracy with interval at
    the first and the last validation, and the paired change between them."""

    kind: str
    name: str
    first: Interval | None
    last: Interval | None
    change: Change | None

    def verdict(self, alpha: float) -> str:
        """``better`` or ``worse`` where the adjusted p-value is under ``alpha``, else ``not significant``."""
        if self.change is None:
            return "no prompt in both"
        if self.change.p_adjusted >= alpha:
            return "not significant"
        return "worse" if self.change.solved_after < self.change.solved_before else "better"


def _domains_as_tags(outcomes: Mapping[str, PromptOutcome]) -> dict[str, PromptOutcome]:
    """The outcomes with each prompt's domain in place of its tag (prefixed, so that no domain is taken for
    ``all``), so that ``intervals`` and ``compare`` give the domains' figures."""
    return {k: PromptOutcome(DOMAIN + prompt_domain(k), o.correct, o.scored) for k, o in outcomes.items()}


DOMAIN = "domain:"


def run_change(
    first: Mapping[str, PromptOutcome], last: Mapping[str, PromptOutcome], alpha: float = 0.05,
    confidence: float = 0.95,
) -> list[ScopeChange]:
    """A run's first validation against its last, paired by prompt: ``all``, then every domain (McNemar's exact
    test, Holm-adjusted over the domains), each followed by its tags (Holm-adjusted over the tags, as ``compare``
    does)."""
    ci_first, ci_last = intervals(first, confidence), intervals(last, confidence)
    by_tag = compare(first, last, alpha)
    domain_first, domain_last = _domains_as_tags(first), _domains_as_tags(last)
    dci_first, dci_last = intervals(domain_first, confidence), intervals(domain_last, confidence)
    by_domain = compare(domain_first, domain_last, alpha)
    # Each tag is listed under the first domain (in sorted order) whose prompts carry it.
    tag_domain: dict[str, str] = {}
    for key, outcome in sorted([*first.items(), *last.items()], key=lambda kv: prompt_domain(kv[0])):
        tag_domain.setdefault(outcome.tag, prompt_domain(key))
    rows = [ScopeChange("all", ALL, ci_first.get(ALL), ci_last.get(ALL), by_tag.get(ALL))]
    for domain in sorted(set(tag_domain.values())):
        scope = DOMAIN + domain
        rows.append(ScopeChange("domain", domain, dci_first.get(scope), dci_last.get(scope), by_domain.get(scope)))
        tags = sorted(t for t, d in tag_domain.items() if d == domain)
        rows += [ScopeChange("tag", t, ci_first.get(t), ci_last.get(t), by_tag.get(t)) for t in tags]
    return rows


#: How far each kind of scope's name is indented: tags under their domain.
INDENT = {"all": "", "domain": "  ", "tag": "    "}


def format_run_change(rows: Sequence[ScopeChange], first_step: int, last_step: int, alpha: float = 0.05,
                      confidence: float = 0.95) -> list[str]:
    """The table of ``run_change``: each scope's accuracy [interval] at both validations, the change in the share
    of its paired prompts solved, the adjusted p-value, and a verdict; a change that is not significant says so."""
    width = max(14, *(len(r.name) + 4 for r in rows))
    head = f"step {first_step}", f"step {last_step}"
    lines = [
        f"{'domain / tag':<{width}}{head[0]:>22}{head[1]:>22}{'change':>9}{'p_holm':>8}  verdict",
    ]
    for r in rows:
        label = INDENT[r.kind] + r.name
        cells = f"{ci_text(r.first):>22}{ci_text(r.last):>22}"
        if r.change is None:
            lines.append(f"{label:<{width}}{cells}{'-':>9}{'-':>8}  {r.verdict(alpha)}")
        else:
            c = r.change
            lines.append(f"{label:<{width}}{cells}{c.difference:>+9.3f}{c.p_adjusted:>8.3f}  {r.verdict(alpha)}")
    lines += [
        f"accuracy [{confidence:.0%} Wilson interval over prompts]; change: the share of the prompts judged at both "
        "steps that were solved, last minus first;",
        f"p_holm: McNemar's exact test, Holm-adjusted over the domains and, apart, over the tags; significant where "
        f"p_holm < {alpha:g}",
    ]
    return lines


def ci_text(interval: Interval | None) -> str:
    """An accuracy and its interval in a table cell; "-" where the scope had no prompt."""
    if interval is None:
        return "-"
    return f"{interval.accuracy:.3f} [{interval.low:.2f}, {interval.high:.2f}]"
