"""Rule-based math reward: find the response's final answer and verify it against the ground truth.

Only what the response says after its thinking counts: the text after the last ``</think>``; a response that
opens ``<think>`` and never closes it has given no answer (``require_thinking`` extends that to responses
without any ``</think>``, for chat templates that open the thinking in the prompt). In that text the answer is
found by the first extractor of ``extract_order`` that finds one:

- ``boxed``: the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced;
- ``answer_tag``: the last ``<answer>...</answer>``;
- ``answer_phrase``: the last "answer is X", "answer: X", "#### X";
- ``last_number``: the last number in the text.

The ground truth may be the answer itself or a whole reference solution in the formats of the common data sets:
GSM8K's (the answer after the final ``#### ``) and MATH's (the last ``\\boxed{...}``); ``reference_answer``
takes the answer out of it.

Verification: two plain numbers (``57``, ``57.0``, ``1,234``, ``$-3$``, ``3/4``, ``25%``) are compared by
value: an integer exactly, anything else within a relative 1e-6 (a percentage also as its fraction: ``25%``
equals ``25`` and ``0.25``); anything
else goes through math-verify, symbolically (``\\frac{1}{2}`` and ``0.5``, ``x = 3`` and ``3``, sets,
intervals, LaTeX and plain text). Units after a number (``12 cm``, ``\\text{ dollars}``, ``90^\\circ``) and
thousands separators (``1,234``, ``1{,}234``, ``1\\,234``) do not change the value.

math-verify's own timeouts use ``signal.alarm``, which works only in a main thread; they are disabled here
(``parsing_timeout=None``, ``timeout_seconds=None``): the reward worker runs each sample in a process of its
pool and kills it at the timeout.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Hashable, Sequence
from fractions import Fraction

from roll_core.rewards.scorer import RewardResult, RewardScorer
from workers.rewards.registry import register_reward_worker

logger = logging.getLogger(__name__)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(?P<answer>.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_TRIGGER = re.compile(r"(?:answer\s*(?:is|=|:)|####)\s*:?\s*", re.IGNORECASE)
_ANSWER_PHRASE = re.compile(_ANSWER_TRIGGER.pattern + r"(?P<answer>[^\n]+)", re.IGNORECASE)
_NUMBER_TOKEN = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:/\d+)?")
# Wrappers that do not change a numeric value: math delimiters, currency, percent, trailing punctuation.
_NUMBER_NOISE = re.compile(r"\\[$%!,;]|\\left|\\right|\\text\{\s*\}|[$%\s]|\.$")
_PERCENT = re.compile(r"\\?%|\\percent\b")
# A thousands separator written as a LaTeX space or a braced comma: 1\,234, 1{,}234, 1~234.
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,;:! ]|\{,\}|~)(?=\d{3}(?!\d))")
# \text{12 cm}: a number that went into the text box together with its unit.
_TEXT_WITH_NUMBER = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{\s*(-?[\d.,/]+(?:\s+[^{}]*)?)\}")
_UNIT_WORDS = re.compile(
    r"^(?P<number>\$?-?(?:\d[\d,]*(?:\.\d+)?|\.\d+))\s*(?P<words>(?:[A-Za-z]{2,}(?:/[A-Za-z]+)?\.?\s*)+)$"
)
# Words after a number that make it an expression, not a unit: "2 pi", "3 sqrt 2", "2 and 3".
_MATH_WORDS = frozenset(
    {"pi", "sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "arcsin", "arccos", "arctan"}
    | {"sinh", "cosh", "tanh", "mod", "and", "or", "to", "plus", "minus", "times", "over", "squared", "cubed"}
)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"

#: Relative and absolute tolerance for plain-number comparison.
_REL_TOL = 1e-6
_ABS_TOL = 1e-9


# --- finding the answer -------------------------------------------------------------------------------------


def after_thinking(response: str, require_thinking: bool = False) -> str:
    """The part of ``response`` that states its answer: after the last ``</think>``; empty when a ``<think>``
    is never closed (or, with ``require_thinking``, when there is no ``</think>`` at all)."""
    close = response.rfind(_THINK_CLOSE)
    if close >= 0:
        return response[close + len(_THINK_CLOSE) :]
    if require_thinking or _THINK_OPEN in response:
        return ""
    return response


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; ``None`` if there is none or it is unclosed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _clean_phrase(answer: str) -> str:
    answer = answer.strip()
    # "The answer is 57. Let me double-check..." -> "57"; a decimal point is followed by a digit.
    answer = re.split(r"\.(?:\s|$)", answer, maxsplit=1)[0]
    answer = answer.strip().strip("*").strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer


def last_answer_phrase(text: str) -> str | None:
    """X of the last "answer is X" / "answer: X" / "#### X" that states something."""
    phrases = []
    for match in _ANSWER_PHRASE.finditer(text):
        raw = match.group("answer")
        # "Final Answer: The final answer is $x$." -> the phrase after the last trigger of the line.
        nested = [m.end() for m in _ANSWER_TRIGGER.finditer(raw)]
        phrase = _clean_phrase(raw[nested[-1] :] if nested else raw)
        if _BOXED.search(phrase):
            phrase = last_boxed(phrase) or ""
        # "the answer is not obvious yet" is prose, not an answer: keep phrases with math, or of one word.
        if phrase and (re.search(r"[\d\\]", phrase) or not re.search(r"\s", phrase)):
            phrases.append(phrase)
    return phrases[-1] if phrases else None


_GSM8K_MARK = re.compile(r"^####\s*(?P<answer>.+?)\s*$", re.MULTILINE)


def reference_answer(ground_truth: str) -> str:
    """The answer a ground truth states: after GSM8K's final ``#### `` line, else in MATH's last ``\\boxed{}``,
    else the ground truth as it is."""
    marks = _GSM8K_MARK.findall(ground_truth)
    if marks:
        return marks[-1]
    boxed = last_boxed(ground_truth)
    return boxed if boxed is not None else ground_truth


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``; the phrase inside it when it is a sentence."""
    tags = [m.group("answer").strip() for m in _ANSWER_TAG.finditer(text)]
    if not tags or not tags[-1]:
        return None
    return last_answer_phrase(tags[-1]) or _clean_phrase(tags[-1])


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234``, ``-2.5``, ``3/4``)."""
    numbers = _NUMBER_TOKEN.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


#: Answer extractors by the name ``extract_order`` uses.
EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": last_boxed,
    "answer_tag": last_answer_tag,
    "answer_phrase": last_answer_phrase,
    "last_number": last_number,
}
DEFAULT_EXTRACT_ORDER = ("boxed", "answer_tag", "answer_phrase", "last_number")


def find_answer(
    response: str, order: Sequence[str] = DEFAULT_EXTRACT_ORDER, require_thinking: bool = False
) -> tuple[str | None, str | None]:
    """(the final answer stated in ``response``, the name of the extractor that found it); (None, None) when
    no extractor finds one."""
    text = after_thinking(response, require_thinking)
    for name in order:
        answer = EXTRACTORS[name](text)
        if answer:
            return answer, name
    return None, None


def extract_answer(response: str, order: Sequence[str] = DEFAULT_EXTRACT_ORDER) -> str | None:
    """The final answer stated in ``response``, as text; ``None`` when no answer can be found."""
    return find_answer(response, order)[0]


# --- comparing answers --------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """``text`` without what does not change its value: delimiters, LaTeX thousands separators, units."""
    text = text.strip().replace("\u2212", "-")
    for opening, closing in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(opening) + len(closing) and text.startswith(opening) and text.endswith(closing):
            text = text[len(opening) : len(text) - len(closing)].strip()
    text = _SPACED_THOUSANDS.sub("", text)
    text = _TEXT_WITH_NUMBER.sub(lambda m: m.group(1), text)
    units = _UNIT_WORDS.fullmatch(text)
    words = re.split(r"[\s/.]+", units.group("words").lower()) if units else []
    if units and not _MATH_WORDS.intersection(words):
        text = units.group("number")
    return text


def parse_number(text: str) -> float | None:
    """``text`` as a plain number (``"1,234"``, ``"-3."``, ``"3/4"``, ``"$57$"``, ``"25%"``), or None."""
    stripped = _NUMBER_NOISE.sub("", text.strip().replace("\u2212", "-"))
    if not _PLAIN_NUMBER.fullmatch(stripped):
        return None
    stripped = stripped.replace(",", "")
    try:
        return float(Fraction(stripped))
    except (ValueError, ZeroDivisionError):
        return None


def _number_values(text: str) -> list[float] | None:
    """The values a plain number may stand for: a percentage also as its fraction (``25%`` -> 25 and 0.25)."""
    value = parse_number(text)
    if value is None:
        return None
    return [value, value / 100] if _PERCENT.search(text) else [value]


def _as_boxed_latex(text: str) -> str:
    # Boxing tells math-verify that the whole string is the answer, rather than to search inside it.
    return text if _BOXED.search(text) else f"\\boxed{{{text}}}"


def _math_verify_equal(answer: str, ground_truth: str) -> bool:
    # Imported here: math-verify pulls in sympy and an ANTLR parser, too slow for an import-time dependency.
    from math_verify import parse, verify

    _silence_math_verify_timeout_notice()

    gold = parse(_as_boxed_latex(ground_truth), parsing_timeout=None)
    predicted = parse(_as_boxed_latex(answer), parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def numbers_match(got: float, expected: float) -> bool:
    """An integer answer must be that integer (3.0 is 3; 8888889 is not 8888888, though within 1e-6 of it); any
    other value is right within a relative 1e-6 (a rounded 0.3333333 for 0.33333333)."""
    if expected.is_integer():
        return got == expected
    return math.isclose(got, expected, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def answers_match(answer: str, ground_truth: str) -> bool:
    """Whether an extracted answer equals the ground truth: by value for plain numbers, else math-verify."""
    answer, ground_truth = normalize_answer(answer), normalize_answer(ground_truth)
    expected, got = _number_values(ground_truth), _number_values(answer)
    if expected is not None and got is not None:
        return any(numbers_match(g, e) for g in got for e in expected)
    return _math_verify_equal(answer, ground_truth)


# --- shaping ------------------------------------------------------------------------------------------------


def thinking_well_formed(response: str) -> bool:
    """At most one thinking block, at the start: ``<think>...</think>answer``, or ``...</think>answer`` when
    the chat template opened it in the prompt, or no thinking tags at all."""
    opens, closes = response.count(_THINK_OPEN), response.count(_THINK_CLOSE)
    if opens > 1 or closes > 1:
        return False
    if opens == 1:
        return closes == 1 and response.lstrip().startswith(_THINK_OPEN)
    return True


def length_penalty(length: int, start: int, end: int, maximum: float) -> float:
    """0 up to ``start``, growing linearly to ``maximum`` at ``end``, and ``maximum`` past it (the shape of
    DAPO's soft overlong punishment, Yu et al. 2025, arXiv:2503.14476)."""
    if length <= start:
        return 0.0
    return maximum * min(1.0, (length - start) / (end - start))


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


def _silence_math_verify_timeout_notice() -> None:
    """math-verify warns, once per process, that its timeouts are off; here they are off by design."""
    for name in ("math_verify.parser", "math_verify.grader"):
        target = logging.getLogger(name)
        if _drop_timeout_notice not in target.filters:
            target.addFilter(_drop_timeout_notice)


@register_reward_worker("math_rule")
class MathRuleScorer(RewardScorer):
    """``correct_score`` when the response's final answer equals the ground truth, else ``wrong_score``;
    plus ``format_score`` when its format is right, minus a length penalty when one is set.

    Options:

    - ``extract_order``: extractors to try, in order (names in ``EXTRACTORS``; default boxed, answer_tag,
      answer_phrase, last_number).
    - ``require_thinking``: only an answer after ``</think>`` counts (for templates that open ``<think>``).
    - ``correct_score`` / ``wrong_score``: the reward for a right / a wrong or missing answer (1.0 / 0.0).
    - ``format_score``: added when the format is right (default 0.0, off). The format is right when the
      thinking tags are well formed (``thinking_well_formed``) and the answer was found by the first extractor
      of ``extract_order`` (by default: it is boxed); or, with ``format_pattern``, when the whole response
      matches that regular expression.
    - ``length_penalty_start_chars`` / ``length_penalty_end_chars`` / ``length_penalty``: subtract up to
      ``length_penalty`` from responses longer than the start, in characters (see ``length_penalty``); off
      unless both bounds are set.

    Metrics: ``answer_found`` and ``format_ok`` (1.0 or 0.0), and ``length_penalty`` when it is on. A sample
    whose verification runs past the worker's timeout is masked and counted by the worker
    (``reward/<domain>/timed_out``, ``masked_timeout``).
    """

    preload_modules = ("math_verify",)

    def __init__(
        self,
        *,
        extract_order: Sequence[str] = DEFAULT_EXTRACT_ORDER,
        require_thinking: bool = False,
        correct_score: float = 1.0,
        wrong_score: float = 0.0,
        format_score: float = 0.0,
        format_pattern: str | None = None,
        length_penalty_start_chars: int | None = None,
        length_penalty_end_chars: int | None = None,
        length_penalty: float = 1.0,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if isinstance(extract_order, str) or not extract_order:
            raise ValueError(f"math_rule: extract_order must be a non-empty list, got {extract_order!r}")
        unknown = [name for name in extract_order if name not in EXTRACTORS]
        if unknown:
            raise ValueError(f"math_rule: unknown extractor(s) {unknown}; known: {sorted(EXTRACTORS)}")
        if len(set(extract_order)) != len(extract_order):
            raise ValueError(f"math_rule: extract_order names an extractor twice: {list(extract_order)}")
        bounds = (length_penalty_start_chars, length_penalty_end_chars)
        if (bounds[0] is None) != (bounds[1] is None):
            raise ValueError(
                "math_rule: set both length_penalty_start_chars and length_penalty_end_chars or none"
            )
        if bounds[0] is not None and not 0 <= bounds[0] < bounds[1]:
            raise ValueError(
                f"math_rule: need 0 <= length_penalty_start_chars < length_penalty_end_chars, got {bounds}"
            )
        if length_penalty < 0:
            raise ValueError(f"math_rule: length_penalty must be >= 0, got {length_penalty}")
        self.extract_order = tuple(extract_order)
        self.require_thinking = require_thinking
        self.correct_score = float(correct_score)
        self.wrong_score = float(wrong_score)
        self.format_score = float(format_score)
        self.format_pattern = re.compile(format_pattern, re.DOTALL) if format_pattern is not None else None
        self.length_bounds = bounds if bounds[0] is not None else None
        self.length_penalty = float(length_penalty)

    has_answer_key = True

    def warm_up(self) -> None:
        answers_match("\\frac{1}{2}", "x = 0.5")

    def answer_key(self, response: str) -> Hashable | None:
        """The answer this scorer would grade: plain numbers by value, so "57", "57.0" and "57." are one vote;
        anything else (LaTeX, expressions) by its stripped text."""
        answer, _ = find_answer(response or "", self.extract_order, self.require_thinking)
        if answer is None:
            return None
        number = parse_number(answer)
        return number if number is not None else answer.strip()

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        if ground_truth is None or not str(ground_truth).strip():
            logger.warning("math_rule: empty ground truth, sample not scored (fields: %s)", sorted(fields))
            return None
        response = response or ""
        answer, found_by = find_answer(response, self.extract_order, self.require_thinking)
        correct = answer is not None and answers_match(answer, reference_answer(str(ground_truth)))
        if self.format_pattern is not None:
            format_ok = self.format_pattern.fullmatch(response) is not None
        else:
            format_ok = found_by == self.extract_order[0] and thinking_well_formed(response)
        score = (self.correct_score if correct else self.wrong_score) + (
            self.format_score if format_ok else 0.0
        )
        metrics = {"answer_found": float(answer is not None), "format_ok": float(format_ok)}
        if self.length_bounds is not None:
            penalty = length_penalty(len(response), *self.length_bounds, self.length_penalty)
            score -= penalty
            metrics["length_penalty"] = penalty
        return RewardResult(score=score, correct=correct, metrics=metrics)
