"""Multiple-choice answers (ROLL's crossthinkqa domain, MMLU-style data): the response must state one option
letter, marked as its answer, and that letter must be the ground truth's.

The marked answer is what the response says after its thinking (math_rule's ``after_thinking``): the last
``\\boxed{...}``, or else the last "answer is X" / "answer: X". It counts when it is one letter of the row's
choices, alone or as people write it (``B``, ``(B)``, ``B.``, ``**B**``, ``$B$``, ``\\text{B}``), or the letter
followed by that option's own text (``B. Paris``, where the row lists its options). Anything else is a wrong
answer: several letters (``ABCD``, ``A or B``, ``A, C``), an answer that is not marked (ROLL's rule reads the first
capital letter of the whole response then, so "Because ..." counts as B), a letter outside the choices, a letter
with another option's text, or an answer given only inside the thinking. Lower-case letters do not count ("the
answer is a ..." is prose).

The ground truth names one letter (``B``, ``(B)``, ``B. Paris``); a row whose ground truth does not is refused by
``roll run``'s data check.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Hashable, Iterator, Mapping

from roll_core.rewards.scorer import RewardResult, RewardScorer, missing_text
from workers.rewards.math_rule import after_thinking, last_boxed
from workers.rewards.registry import register_reward_worker

_TRIGGER = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_WRAPPED = (
    re.compile(r"^\*\*(.*)\*\*$", re.DOTALL),
    re.compile(r"^\$(.*)\$$", re.DOTALL),
    re.compile(r"^\\(?:text|textbf|mathrm|mathbf)\s*\{(.*)\}$", re.DOTALL),
    re.compile(r"^\((.*)\)$", re.DOTALL),
    re.compile(r"^\[(.*)\]$", re.DOTALL),
)
_LETTER_WITH_TEXT = re.compile(r"^\(?(?P<letter>[A-Z])(?:\)|\.|:|\))\s*(?P<text>.+)$", re.DOTALL)
_REFERENCE = re.compile(r"^\(?(?P<letter>[A-Z])\)?(?:[.:)\s].*)?$", re.DOTALL)


def marked_answer(response: str) -> str | None:
    """What the response marks as its answer after its thinking: the last ``\\boxed{}``, else the text after
    the last "answer is" / "answer:"; None when it marks none."""
    text = after_thinking(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    triggers = list(_TRIGGER.finditer(text))
    return text[triggers[-1].end() :].split("\n", 1)[0] if triggers else None


def _unwrap(answer: str) -> str:
    """The answer without the marks around it: trailing punctuation, bold, math dollars, \\text{}, brackets."""
    previous = None
    while answer != previous:
        previous = answer
        answer = answer.strip().rstrip(".;,!").strip()
        for wrapper in _WRAPPED:
            match = wrapper.match(answer)
            if match:
                answer = match.group(1)
                break
    return answer


def _normal(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".;,!")


def stated_letter(answer: str, choices: str, options: Mapping[str, str] | None = None) -> str | None:
    """The one choice letter `answer` states, or None: several letters, prose, a letter outside `choices`, or a
    letter followed by text that is not that option's (`options`: letter -> option text, where known)."""
    core = _unwrap(answer)
    if len(core) == 1:
        return core if core in choices else None
    match = _LETTER_WITH_TEXT.match(core)
    if match is None or options is None:
        return None
    letter = match.group("letter")
    if letter not in choices or letter not in options:
        return None
    return letter if _normal(_unwrap(match.group("text"))) == _normal(str(options[letter])) else None


def reference_letter(ground_truth: object) -> str | None:
    """The letter a ground truth names (``B``, ``(B)``, ``B. Paris``), or None."""
    match = _REFERENCE.match(str(ground_truth or "").strip())
    return match.group("letter") if match else None


def row_options(options: object) -> dict[str, str] | None:
    """A row's ``options`` column as letter -> text: a list (A, B, ... in order) or a mapping by letter, or
    either written as JSON text (as ROLL's rows carry their columns)."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError:
            return None
    if isinstance(options, Mapping):
        return {str(k).strip().upper(): str(v) for k, v in options.items()}
    if isinstance(options, list | tuple):
        return {string.ascii_uppercase[i]: str(v) for i, v in enumerate(options[:26])}
    return None


@register_reward_worker("multiple_choice")
class MultipleChoiceScorer(RewardScorer):
    """``correct_score`` when the response marks exactly the ground truth's letter as its answer, else
    ``wrong_score``.

    Options:

    - ``choices``: the letters a response may state when the row has no ``options`` column (default A to J, as
      MMLU-Pro's ten options). With ``options`` (a list of option texts, or a mapping letter -> text) the choices
      are that row's letters.
    - ``correct_score`` / ``wrong_score``: 1.0 / 0.0.

    Metrics: ``answer_found`` (the response marks an answer) and ``answer_valid`` (that answer is one choice).
    """

    def __init__(
        self, *, choices: str = "ABCDEFGHIJ", correct_score: float = 1.0, wrong_score: float = 0.0, **options: object
    ) -> None:
        super().__init__(**options)
        if not choices or any(c not in string.ascii_uppercase for c in choices) or len(set(choices)) != len(choices):
            raise ValueError(f"multiple_choice: choices must be distinct capital letters, got {choices!r}")
        self.choices = choices
        self.correct_score, self.wrong_score = float(correct_score), float(wrong_score)

    @classmethod
    def check_row(cls, row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
        problems = list(missing_text(row, "ground_truth"))
        yield from problems
        if not problems and reference_letter(row["ground_truth"]) is None:
            yield "ground_truth", f"names no option letter (A, (B), C. text ...): {str(row['ground_truth'])[:60]!r}"
        if "options" in row:
            options = row_options(row["options"])
            if options is None:
                yield "options", "must be a list of option texts or a mapping from letter to text"
            elif not problems and reference_letter(row["ground_truth"]) not in (*options, None):
                yield "ground_truth", f"names {reference_letter(row['ground_truth'])}, not one of the options {list(options)}"

    has_answer_key = True

    def answer_key(self, response: str) -> Hashable | None:
        answer = marked_answer(response or "")
        return None if answer is None else stated_letter(answer, self.choices)

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        reference = reference_letter(ground_truth)
        if reference is None:  # refused by check_row; a row that changed after the check is not the policy's doing
            return None
        options = row_options(fields.get("options"))
        choices = "".join(options) if options is not None else self.choices
        answer = marked_answer(response or "")
        letter = None if answer is None else stated_letter(answer, choices, options)
        correct = letter == reference
        return RewardResult(
            score=self.correct_score if correct else self.wrong_score,
            correct=correct,
            metrics={"answer_found": float(answer is not None), "answer_valid": float(letter is not None)},
        )
