"""Instruction following with verifiable constraints (IFEval-style; ROLL's ifeval domain).

A row's ground truth names one constraint and its arguments, as ROLL's and open-instruct's RLVR-IFeval rows do:
``{"func_name": "validate_word_constraint", "N": 50, "quantifier": "at least", ...}`` (a JSON object or its text;
arguments the constraint does not take, or null, are ignored). The response, after its thinking (math_rule's
``after_thinking``), scores ``correct_score`` when it satisfies the constraint, else ``wrong_score``.

The checks are written here (the maintained IFEval code, in lm-eval, needs nltk's tokenizer data downloaded at run
time). They follow ROLL's names and arguments, without the loopholes its checks leave a policy:

- an empty response satisfies nothing (ROLL pays it for "choose one of the options", "no commas", "all lowercase");
- `verify_keyword_frequency` counts the keyword (ROLL's counts every word, so any N-word response passes);
- highlights, placeholders and titles must hold text (``**``, ``[]`` and ``<<>>`` count in ROLL's);
- a choice must name exactly one option, JSON must be an object or array (``1`` is JSON), a quotation must quote
  something, two responses must both be there and differ, upper/lower case needs letters, a postscript needs text
  after its marker, an ending or a repeated prompt needs a response besides it;
- bullets are lines opening with ``* `` or ``- `` and text (not a ``* * *`` separator).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from roll_core.rewards.scorer import RewardResult, RewardScorer, missing_text
from workers.rewards.math_rule import after_thinking
from workers.rewards.registry import register_reward_worker

QUANTIFIERS = ("at least", "at most", "around")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text.lower())


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word.lower())}(?!\w)", text.lower()) is not None


def _compare(count: int, N: int, quantifier: str, around: int) -> bool:
    if quantifier == "at least":
        return count >= N
    if quantifier == "at most":
        return count <= N
    return abs(count - N) <= around


def verify_keywords(text: str, keyword_list: list[str]) -> bool:
    """Every keyword appears (as a word or phrase, any case)."""
    return all(_has_word(text, k) for k in keyword_list)


def verify_keyword_frequency(text: str, word: str, N: int) -> bool:
    """The word appears exactly N times (any case)."""
    return len(re.findall(rf"(?<!\w){re.escape(word.lower())}(?!\w)", text.lower())) == N


def validate_forbidden_words(text: str, forbidden_words: list[str]) -> bool:
    """None of the words appears (as a word, any case)."""
    return not any(_has_word(text, w) for w in forbidden_words)


def verify_letter_frequency(text: str, letter: str, N: int) -> bool:
    """The letter (as written: case counts) appears exactly N times."""
    return len(letter) == 1 and text.count(letter) == N


def validate_response_language(text: str, language: str) -> bool:
    """The response is in `language` (an ISO 639-1 code), by langdetect with a fixed seed."""
    from langdetect import DetectorFactory, detect
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = 0
    try:
        return detect(text) == language
    except LangDetectException:  # no letters to go by
        return False


def _lines_clean(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines()).strip()


def verify_paragraph_count(text: str, N: int) -> bool:
    """Exactly N non-empty paragraphs separated by ``* * *``."""
    paragraphs = _lines_clean(text).split("* * *")
    return all(p.strip() for p in paragraphs) and len(paragraphs) == N


def validate_word_constraint(text: str, N: int, quantifier: str) -> bool:
    """The word count is at least / at most / around N (around: within 10%, at least 1)."""
    return _compare(len(text.split()), N, quantifier, max(round(N * 0.1), 1))


_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=\S)")


def verify_sentence_constraint(text: str, N: int, quantifier: str) -> bool:
    """The sentence count (ends at . ? or ! before a space) is at least / at most / around N (around: +-1)."""
    return _compare(len(_SENTENCE_END.split(text.strip())), N, quantifier, 1)


def validate_paragraphs(text: str, N: int, first_word: str, i: int) -> bool:
    """Exactly N paragraphs separated by blank lines, the i-th (from 1) opening with `first_word`."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    if len(paragraphs) != N or not 1 <= i <= N:
        return False
    return re.match(rf"{re.escape(first_word)}(?!\w)", paragraphs[i - 1].strip(), re.IGNORECASE) is not None


def verify_postscript(text: str, postscript_marker: str) -> bool:
    """A postscript: the marker, then text after it."""
    at = text.rfind(postscript_marker)
    return at >= 0 and bool(text[at + len(postscript_marker) :].strip(" \t\n:.-"))


def validate_placeholders(text: str, N: int) -> bool:
    """At least N square-bracket placeholders with a name inside, like [address]."""
    return len([p for p in re.findall(r"\[([^\[\]]*)\]", text) if p.strip()]) >= N


def verify_bullet_points(text: str, N: int) -> bool:
    """Exactly N bullet lines (``* text`` or ``- text``)."""
    return len([line for line in text.splitlines() if re.match(r"\s*[*-]\s+\S", line) and not re.fullmatch(r"\s*[*\s]+", line)]) == N


def validate_title(text: str) -> bool:
    """A title in double angle brackets, with text: <<like this>>."""
    return any(t.strip() for t in re.findall(r"<<([^<>]*)>>", text))


def validate_choice(text: str, options: list[str]) -> bool:
    """The response states exactly one of the options."""
    return len([o for o in options if str(o).strip() and _has_word(text, str(o).strip())]) == 1


def validate_highlighted_sections(text: str, N: int) -> bool:
    """At least N highlighted sections with text, *like this* or **like this**."""
    spans = re.findall(r"\*\*([^*\n]+)\*\*|\*([^*\n]+)\*", text)
    return sum(1 for double, single in spans if (double or single).strip()) >= N


def validate_sections(text: str, N: int, section_splitter: str) -> bool:
    """Exactly N sections, each opening with the splitter (e.g. "Section 1") and holding text."""
    parts = text.split(section_splitter)
    if parts and not parts[0].strip():
        parts = parts[1:]
    return len(parts) == N and all(re.sub(r"^\s*\d*[.:]?", "", p).strip() for p in parts)


def validate_json_format(text: str) -> bool:
    """The whole response is a JSON object or array (a Markdown code fence around it allowed)."""
    body = re.sub(r"^\s*```(?:json)?\s*|\s*```\s*$", "", text, flags=re.IGNORECASE)
    try:
        return isinstance(json.loads(body), dict | list)
    except ValueError:
        return False


def validate_repeat_prompt(text: str, original_prompt: str) -> bool:
    """The response opens with the prompt, word for word, then answers it."""
    start = text.lstrip()
    return start.startswith(original_prompt.strip()) and bool(start[len(original_prompt.strip()) :].strip())


def validate_two_responses(text: str) -> bool:
    """Two different, non-empty responses separated by ``******``."""
    parts = text.split("******")
    return len(parts) == 2 and all(p.strip() for p in parts) and parts[0].strip() != parts[1].strip()


def validate_uppercase(text: str) -> bool:
    """Letters, all capital."""
    return any(c.isalpha() for c in text) and text == text.upper()


def validate_lowercase(text: str) -> bool:
    """Letters, all lower case."""
    return any(c.isalpha() for c in text) and text == text.lower()


def validate_frequency_capital_words(text: str, N: int, quantifier: str) -> bool:
    """Words in capitals: at least / at most / exactly (around) N."""
    return _compare(len(re.findall(r"\b[A-Z]+\b", text)), N, quantifier, 0)


def validate_end(text: str, end_phrase: str) -> bool:
    """The response ends with the phrase, after a response."""
    body, phrase = text.strip(), end_phrase.strip()
    return body.endswith(phrase) and bool(body[: len(body) - len(phrase)].strip())


def validate_quotation(text: str) -> bool:
    """The whole response is in double quotes, with something quoted."""
    return re.fullmatch(r'"\s*[^\s"].*"', text.strip(), re.DOTALL) is not None


def validate_no_commas(text: str) -> bool:
    """No comma."""
    return "," not in text


CONSTRAINTS: dict[str, Callable[..., bool]] = {
    f.__name__: f
    for f in (
        verify_keywords, verify_keyword_frequency, validate_forbidden_words, verify_letter_frequency,
        validate_response_language, verify_paragraph_count, validate_word_constraint, verify_sentence_constraint,
        validate_paragraphs, verify_postscript, validate_placeholders, verify_bullet_points, validate_title,
        validate_choice, validate_highlighted_sections, validate_sections, validate_json_format,
        validate_repeat_prompt, validate_two_responses, validate_uppercase, validate_lowercase,
        validate_frequency_capital_words, validate_end, validate_quotation, validate_no_commas,
    )
}
"""ROLL's constraint names (func_name) -> their checks."""


def parse_constraint(ground_truth: object) -> tuple[str, dict[str, Any]]:
    """(func_name, the arguments its check takes) from a ground truth; ValueError naming what is wrong."""
    spec = ground_truth
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError("is not a JSON object with a func_name") from None
    if not isinstance(spec, Mapping) or "func_name" not in spec:
        raise ValueError("is not a JSON object with a func_name")
    name = spec["func_name"]
    if name not in CONSTRAINTS:
        raise ValueError(f"func_name {name!r} is not a known constraint (known: {', '.join(sorted(CONSTRAINTS))})")
    params = list(inspect.signature(CONSTRAINTS[name]).parameters)[1:]
    args = {k: spec[k] for k in params if spec.get(k) is not None}
    missing = [k for k in params if k not in args]
    if missing:
        raise ValueError(f"{name} needs {', '.join(missing)}")
    if "quantifier" in args and args["quantifier"] not in QUANTIFIERS:
        raise ValueError(f"{name}: quantifier must be one of {list(QUANTIFIERS)}, got {args['quantifier']!r}")
    return name, args


@register_reward_worker("ifeval")
class IFEvalScorer(RewardScorer):
    """``correct_score`` when the response (after its thinking) satisfies the row's constraint, else
    ``wrong_score``; an empty response satisfies none.

    Options: ``correct_score`` / ``wrong_score`` (1.0 / 0.0). Metrics: ``empty`` (the response said nothing after
    its thinking).
    """

    preload_modules = ("langdetect",)

    def __init__(self, *, correct_score: float = 1.0, wrong_score: float = 0.0, **options: object) -> None:
        super().__init__(**options)
        self.correct_score, self.wrong_score = float(correct_score), float(wrong_score)

    @classmethod
    def check_row(cls, row: Mapping[str, object]) -> Iterator[tuple[str, str]]:
        if row.get("ground_truth") is None or (isinstance(row["ground_truth"], str) and not row["ground_truth"].strip()):
            yield from missing_text(row, "ground_truth")
            return
        try:
            parse_constraint(row["ground_truth"])
        except ValueError as err:
            yield "ground_truth", str(err)

    def score(self, response: str, ground_truth: object, **fields: object) -> RewardResult | None:
        try:
            name, args = parse_constraint(ground_truth)
        except ValueError:  # refused by check_row: a row, not the policy's output
            return None
        text = after_thinking(response or "")
        empty = not text.strip()
        correct = not empty and bool(CONSTRAINTS[name](text, **args))
        return RewardResult(
            score=self.correct_score if correct else self.wrong_score, correct=correct, metrics={"empty": float(empty)}
        )
