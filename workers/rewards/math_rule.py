"""Rule-based math reward: extract the final answer from a response and compare it with the ground truth.

Extraction, in order: the last ``\\boxed{...}`` (or ``\\fbox{...}``); else the last "answer is X" /
"answer: X" / "#### X" phrase; else the last number in the text. Comparison: plain numbers (``57``, ``57.0``,
``1,234``, ``-3``, ``3/4``) are compared numerically with a small tolerance; anything else (``\\frac{1}{2}``,
``\\sqrt{2}``, ``x+1``) goes through math-verify.

math-verify's own timeouts use ``signal.alarm``, which only works in the main thread; they are disabled here
(``parsing_timeout=None``, ``timeout_seconds=None``) and the per-sample timeout is the reward worker's job.
"""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction

from workers.rewards.base import RewardResult, RewardScorer
from workers.rewards.registry import register_reward_worker

logger = logging.getLogger(__name__)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_PHRASE = re.compile(
    r"(?:answer\s*(?:is|=|:)|####)\s*:?\s*(?P<answer>[^\n]+)",
    re.IGNORECASE,
)
_NUMBER_TOKEN = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:/\d+)?")
# Wrappers that do not change a numeric value: math delimiters, currency, percent, trailing punctuation.
_NUMBER_NOISE = re.compile(r"\\[$%!,;]|\\left|\\right|\\text\{\s*\}|[$%\s]|\.$")

#: Relative and absolute tolerance for plain-number comparison.
_REL_TOL = 1e-6
_ABS_TOL = 1e-9


def _last_boxed(text: str) -> str | None:
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


def extract_answer(response: str) -> str | None:
    """The final answer stated in ``response``, as text; ``None`` when no answer can be found."""
    boxed = _last_boxed(response)
    if boxed:
        return boxed
    phrases = [_clean_phrase(m.group("answer")) for m in _ANSWER_PHRASE.finditer(response)]
    # "the answer is not obvious yet" is prose, not an answer: keep phrases with math in them or one token.
    phrases = [p for p in phrases if p and (re.search(r"[\d\\]", p) or not re.search(r"\s", p))]
    if phrases:
        return phrases[-1]
    numbers = _NUMBER_TOKEN.findall(response)
    if numbers:
        return numbers[-1].replace(" ", "")
    return None


def parse_number(text: str) -> float | None:
    """``text`` as a plain number (``"1,234"``, ``"-3."``, ``"3/4"``, ``"$57$"``), else ``None``."""
    stripped = _NUMBER_NOISE.sub("", text.strip().replace("\u2212", "-"))
    if not _PLAIN_NUMBER.fullmatch(stripped):
        return None
    stripped = stripped.replace(",", "")
    try:
        return float(Fraction(stripped))
    except (ValueError, ZeroDivisionError):
        return None


def _math_verify_equal(answer: str, ground_truth: str) -> bool:
    # Imported here: math-verify pulls in sympy and an ANTLR parser, too slow for an import-time dependency.
    from math_verify import parse, verify

    def as_latex(text: str) -> str:
        text = text.strip()
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$")
        # Boxing tells math-verify the whole string is the answer, rather than to search inside it.
        return text if _BOXED.search(text) else f"\\boxed{{{text}}}"

    gold = parse(as_latex(ground_truth), parsing_timeout=None)
    predicted = parse(as_latex(answer), parsing_timeout=None)
    if not gold or not predicted:
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def answers_match(answer: str, ground_truth: str) -> bool:
    """Whether an extracted answer equals the ground truth: numerically for plain numbers, else by math-verify."""
    expected, got = parse_number(ground_truth), parse_number(answer)
    if expected is not None and got is not None:
        return math.isclose(got, expected, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
    return _math_verify_equal(answer, ground_truth)


@register_reward_worker("math_rule")
class MathRuleScorer(RewardScorer):
    """1.0 when the response's final answer equals the ground truth, else 0.0.

    Takes no options. Metrics: ``answer_found`` (1.0 when an answer could be extracted at all).
    """

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        if ground_truth is None or not str(ground_truth).strip():
            logger.warning("math_rule: empty ground truth, sample not scored (fields: %s)", sorted(fields))
            return None
        answer = extract_answer(response or "")
        if answer is None:
            return RewardResult(score=0.0, correct=False, metrics={"answer_found": 0.0})
        correct = answers_match(answer, str(ground_truth))
        return RewardResult(score=1.0 if correct else 0.0, correct=correct, metrics={"answer_found": 1.0})
