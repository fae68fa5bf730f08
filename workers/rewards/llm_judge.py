"""LLM-as-judge reward: a judge model decides whether a response answers the question.

For open-ended domains, where no rule can check an answer, the scorer fills a prompt template with the
question, the reference answer and the response, sends it to a judge model, and reads the verdict from the
judge's reply in the declared ``verdict_format``. The judge is one of two backends (``options.backend``):

- ``http`` (default): ``/v1/chat/completions`` of any OpenAI-compatible server (``roll serve``, vLLM, a hosted
  API); see ``workers.rewards.judge.client``;
- ``ray_actor``: a Hugging Face model (``options.model_path``) loaded in a Ray actor that the reward worker
  starts, batching the samples judged at the same time; see ``workers.rewards.judge.local``.

The verdict formats:

- ``yes_no``: ``Verdict: YES`` / ``Verdict: NO`` (also ``[[YES]]``, a bare ``yes``, or a lone upper-case
  ``YES`` or ``NO`` in the reply); YES is 1, NO is 0;
- ``score``: the last ``[[N]]`` with ``0 <= N <= score_max``, taken as ``N / score_max``;
- ``json``: the last JSON object in the reply with a ``score`` (as above) or a ``verdict`` (yes/no,
  true/false, correct/incorrect).

The verdict ``v`` in [0, 1] becomes the reward ``wrong_score + v * (correct_score - wrong_score)``; the
response counts as correct when ``v >= correct_threshold``.

A judge that cannot be reached (connection refused, timeouts, 5xx after the retries; a judge actor that died
or does not answer in time), that rejects the request (another 4xx; a prompt longer than the local judge's
context), or whose reply holds no verdict in the declared format never gives a reward of 0: ``score``
raises ``JudgeUnreachable``, ``JudgeRejected`` or ``JudgeVerdictUnparseable`` (``workers.rewards.judge.errors``), and the reward worker masks the
sample and counts it (``reward/<domain>/masked_error``; the exception's name is in the worker's warning).

The question is the last user message of the prompt the policy saw (the sample's ``prompt_messages``, which a
run fills), or, where there is none (``roll rewards score``), the sample's ``question`` field. The API key, if the judge needs one, is read from the environment variable named by ``api_key_env``,
never from the config. See ``workers.rewards.judge`` for the HTTP client (retries with exponential backoff)
and the concurrency and rate limits, which every scoring process on a machine that calls the same judge
shares.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import string
import time
from collections.abc import Mapping

from roll_core.rewards.scorer import RewardResult, RewardScorer
from workers.rewards.judge.errors import JudgeVerdictUnparseable
from workers.rewards.registry import register_reward_worker

logger = logging.getLogger(__name__)

#: The judge prompt unless ``template`` is given: placeholders ``{question}``, ``{reference}``,
#: ``{response}``.
DEFAULT_TEMPLATE = (
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Response: {response}\n"
    "Does the final answer of the response match the reference answer? "
    'Reply "Verdict: YES" or "Verdict: NO".'
)
TEMPLATE_FIELDS = frozenset({"question", "reference", "response"})
VERDICT_FORMATS = ("yes_no", "score", "json")
#: Where the judge runs: behind an OpenAI-compatible API, or in a Ray actor the reward worker starts.
BACKENDS = ("http", "ray_actor")
#: What the template gets for ``{question}`` when the sample carries none.
MISSING_QUESTION = "(not given)"

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_YES_WORDS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "no": 0.0, "incorrect": 0.0, "false": 0.0}
_VERDICT_PHRASE = re.compile(r"\bverdict\b[\s*_:=\-\"'`]*\b(yes|no|correct|incorrect)\b", re.IGNORECASE)
_BRACKETED_YES_NO = re.compile(r"\[\[\s*(yes|no)\s*\]\]", re.IGNORECASE)
_BARE_YES_NO = re.compile(r"[\s*_`'\".!]*(yes|no)[\s*_`'\".!]*", re.IGNORECASE)
_UPPER_YES_NO = re.compile(r"\b(YES|NO)\b")
_BRACKETED_SCORE = re.compile(r"\[\[\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*\d+(?:\.\d+)?\s*)?\]\]")


# --- the prompt ---------------------------------------------------------------------------------------------


def check_template(template: str) -> None:
    """Raise ``ValueError`` unless ``template`` is a format string over question, reference and response that
    uses ``{response}``."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"llm_judge: template is not a valid format string: {err}") from err
    unknown = sorted(names - TEMPLATE_FIELDS)
    if unknown:
        raise ValueError(
            f"llm_judge: template uses unknown placeholder(s) {unknown}; known: {sorted(TEMPLATE_FIELDS)} "
            "(write a literal brace as {{ or }})"
        )
    if "response" not in names:
        raise ValueError("llm_judge: template must contain {response}")


def question_of(fields: Mapping[str, object]) -> str | None:
    """The question a response answers: the last user message of ``prompt_messages``, else the ``question``
    field; None when neither has text."""
    question = None
    messages = fields.get("prompt_messages")
    if isinstance(messages, list):
        question = next(
            (m.get("content") for m in reversed(messages) if isinstance(m, Mapping) and m.get("role") == "user"),
            None,
        )
    if question is None:
        question = fields.get("question")
    return None if question is None or not str(question).strip() else str(question)


def render_prompt(template: str, question: str | None, reference: str, response: str) -> str:
    """The judge prompt: ``template`` with the three fields filled in (their own braces are kept as they
    are)."""
    return template.format(
        question=MISSING_QUESTION if question is None else question, reference=reference, response=response
    )


def final_answer_text(response: str) -> str | None:
    """What a response says after its thinking: the text after the last ``</think>``; ``None`` when a
    ``<think>`` is never closed (the response gave no answer)."""
    close = response.rfind(_THINK_CLOSE)
    if close >= 0:
        return response[close + len(_THINK_CLOSE) :]
    if _THINK_OPEN in response:
        return None
    return response


# --- the verdict --------------------------------------------------------------------------------------------


def parse_verdict(reply: str, verdict_format: str, score_max: float = 10.0) -> float | None:
    """The verdict in ``reply`` as a number in [0, 1], or ``None`` when the reply holds none in that format.

    Only the text after the judge's own thinking (the last ``</think>``) is read; when several verdicts are
    given, the last one counts (judges reason first and conclude at the end).
    """
    if verdict_format not in VERDICT_FORMATS:
        raise ValueError(f"unknown verdict_format {verdict_format!r}; known: {list(VERDICT_FORMATS)}")
    text = reply[reply.rfind(_THINK_CLOSE) + len(_THINK_CLOSE) :] if _THINK_CLOSE in reply else reply
    if verdict_format == "yes_no":
        return _parse_yes_no(text)
    if verdict_format == "score":
        return _parse_score(text, score_max)
    return _parse_json(text, score_max)


def _parse_yes_no(text: str) -> float | None:
    for pattern in (_VERDICT_PHRASE, _BRACKETED_YES_NO):
        found = pattern.findall(text)
        if found:
            return _YES_WORDS[found[-1].lower()]
    bare = _BARE_YES_NO.fullmatch(text)
    if bare:
        return _YES_WORDS[bare.group(1).lower()]
    # A lone upper-case YES or NO ("The answer is right. YES"); both in one reply is no verdict.
    shouted = set(_UPPER_YES_NO.findall(text))
    if len(shouted) == 1:
        return _YES_WORDS[shouted.pop().lower()]
    return None


def _in_range(value: float, score_max: float) -> float | None:
    if not math.isfinite(value) or not 0 <= value <= score_max:
        return None
    return value / score_max


def _parse_score(text: str, score_max: float) -> float | None:
    found = _BRACKETED_SCORE.findall(text)
    return _in_range(float(found[-1]), score_max) if found else None


def _parse_json(text: str, score_max: float) -> float | None:
    decoder = json.JSONDecoder()
    for start in reversed([m.start() for m in re.finditer(r"\{", text)]):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(obj, dict):
            verdict = _json_verdict(obj, score_max)
            if verdict is not None:
                return verdict
    return None


def _json_verdict(obj: dict, score_max: float) -> float | None:
    lowered = {str(key).lower(): value for key, value in obj.items()}
    if "score" in lowered:
        value = lowered["score"]
        if isinstance(value, bool):
            return None
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                return None
        return _in_range(float(value), score_max) if isinstance(value, int | float) else None
    for key in ("verdict", "correct"):
        value = lowered.get(key)
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and value.strip().lower() in _YES_WORDS:
            return _YES_WORDS[value.strip().lower()]
    return None


# --- the scorer ---------------------------------------------------------------------------------------------


def _check_http_options(
    base_url: object, model: object, api_key_env: object, model_path: object, actor: object
) -> None:
    if not base_url or not isinstance(base_url, str):
        raise ValueError("llm_judge: options.base_url is required, e.g. http://127.0.0.1:8011/v1")
    if not re.match(r"^https?://", base_url):
        raise ValueError(f"llm_judge: base_url must start with http:// or https://, got {base_url!r}")
    if not model or not isinstance(model, str):
        raise ValueError("llm_judge: options.model is required (the name the judge server serves)")
    if api_key_env is not None and (not isinstance(api_key_env, str) or not api_key_env):
        raise ValueError(f"llm_judge: api_key_env must name an environment variable, got {api_key_env!r}")
    _refuse("http", model_path=model_path, actor=actor)


def _refuse(backend: str, **given: object) -> None:
    """Options of the other backend are an error, not silently ignored."""
    wrong = sorted(name for name, value in given.items() if value is not None)
    if wrong:
        raise ValueError(f"llm_judge: option(s) {wrong} do not apply to backend {backend}")


@register_reward_worker("llm_judge")
class LLMJudgeScorer(RewardScorer):
    """Asks a judge model whether the response matches the reference answer; see the module docstring.

    Options (``rewards.<domain>.options``):

    - ``backend``: ``http`` (default), a judge behind an OpenAI-compatible API, or ``ray_actor``, a local
      judge model in a Ray actor.
    - ``base_url`` (``http``, required): the judge's OpenAI-compatible API, e.g. ``http://127.0.0.1:8011/v1``.
    - ``model`` (``http``, required): the model name the judge serves.
    - ``api_key_env`` (``http``): name of the environment variable that holds the API key (sent as a bearer
      token); the key itself never goes in the config. Unset: no key is sent.
    - ``model_path`` (``ray_actor``, required): the judge's Hugging Face folder (or a run's checkpoint, as for
      `roll serve`), absolute or relative to the working directory of the reward worker's process (for the
      local Ray cluster of `roll run`, where it was started; the config loader does not resolve options).
    - ``actor`` (``ray_actor``): the judge actor's settings, ``workers.rewards.judge.local.LocalJudgeSpec``:
      ``dtype``, ``max_batch_size`` (32), ``torch_threads`` (1), ``num_cpus`` (0), ``num_gpus`` (0),
      ``max_restarts`` (3), ``name``, ``load_timeout_s`` (600). The reward worker creates the actor when it
      starts and waits until the model is loaded; the actor dies with the worker.
    - ``template``: the judge prompt, with ``{question}``, ``{reference}`` and ``{response}``
      (default ``DEFAULT_TEMPLATE``); ``system_prompt``: a system message before it (default none).
    - ``verdict_format``: ``yes_no`` (default), ``score`` (``[[N]]``) or ``json``; ``score_max``: the top of
      the score scale (10).
    - ``correct_score`` / ``wrong_score``: rewards for a verdict of 1 / 0, linear in between (1.0 / 0.0);
      ``correct_threshold``: the verdict from which the response counts as correct (0.5).
    - ``max_tokens`` (256) and ``temperature`` (0.0) of the judge's reply.
    - ``strip_thinking`` (true): judge only what follows the response's last ``</think>``; a response that
      opens ``<think>`` and never closes it gave no answer and gets ``wrong_score`` without a judge call.
      ``max_response_chars`` (4000): longer responses are cut to their last that many characters.
    - ``request_timeout_s`` (30): limit of one HTTP request (of one call to the judge actor);
      ``max_retries`` (3) more attempts after a connection error, a timeout, a 5xx, a 408 or a 429 (a
      judge actor that does not answer in time or is being restarted; not one that died), waiting ``backoff_s`` (0.5) doubled at each retry up
      to ``backoff_max_s`` (8), with jitter (a 429's ``Retry-After`` is honoured up to ``backoff_max_s``);
      ``total_timeout_s``: stop retrying once this much time has passed (default: no bound but the
      attempts). Keep the worst case below the worker's ``rewards.<domain>.timeout_s``, else the worker kills
      the call and counts a timeout instead.
    - ``max_concurrency``: judge requests in flight at once; ``requests_per_minute`` and ``tokens_per_minute``
      (prompt characters / 4 + ``max_tokens`` reserved up front, corrected by the reply's usage): shared by
      every scoring process on this machine that calls the same ``base_url`` and ``model`` (default: no
      limit); ``http`` only (the judge actor batches what it gets, up to ``actor.max_batch_size``).

    Metrics per scored sample: ``judge_verdict`` (the verdict in [0, 1]), ``judge_attempts`` (HTTP requests it
    took), ``judge_latency_s``, ``answer_found`` (0 when an unclosed ``<think>`` or an empty response gave
    nothing to judge) and ``question_given`` (0 when the sample had no question).
    """

    #: Reward audits check this scorer's verdicts against the math rule's on rule-checkable answers.
    audit_as_judge = True

    preload_modules = (
        "requests",
        "workers.rewards.judge.client",
        "workers.rewards.judge.limits",
        "workers.rewards.judge.local",
    )

    @classmethod
    def io_bound(cls, options) -> bool:
        return True  # an HTTP endpoint or the local judge actor: the scorer waits for a reply

    def __init__(
        self,
        *,
        backend: str = "http",
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str | None = None,
        model_path: str | None = None,
        actor: dict | None = None,
        template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
        verdict_format: str = "yes_no",
        score_max: float = 10.0,
        correct_score: float = 1.0,
        wrong_score: float = 0.0,
        correct_threshold: float = 0.5,
        max_tokens: int = 256,
        temperature: float = 0.0,
        strip_thinking: bool = True,
        max_response_chars: int = 4000,
        request_timeout_s: float = 30.0,
        total_timeout_s: float | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_concurrency: int | None = None,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        **options: object,
    ) -> None:
        super().__init__(**options)
        if backend not in BACKENDS:
            raise ValueError(f"llm_judge: backend must be one of {list(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.local = None
        if backend == "http":
            _check_http_options(base_url, model, api_key_env, model_path, actor)
        else:
            _refuse(
                "ray_actor",
                base_url=base_url,
                model=model,
                api_key_env=api_key_env,
                max_concurrency=max_concurrency,
                requests_per_minute=requests_per_minute,
                tokens_per_minute=tokens_per_minute,
            )
        check_template(template)
        if verdict_format not in VERDICT_FORMATS:
            raise ValueError(
                f"llm_judge: verdict_format must be one of {list(VERDICT_FORMATS)}, got {verdict_format!r}"
            )
        if score_max <= 0:
            raise ValueError(f"llm_judge: score_max must be > 0, got {score_max}")
        if not 0 <= correct_threshold <= 1:
            raise ValueError(f"llm_judge: correct_threshold must be in [0, 1], got {correct_threshold}")
        if max_tokens < 1 or max_response_chars < 1:
            raise ValueError("llm_judge: max_tokens and max_response_chars must be >= 1")
        if request_timeout_s <= 0 or (total_timeout_s is not None and total_timeout_s <= 0):
            raise ValueError("llm_judge: request_timeout_s and total_timeout_s must be > 0")
        if max_retries < 0 or backoff_s < 0 or backoff_max_s < backoff_s:
            raise ValueError("llm_judge: need max_retries >= 0 and 0 <= backoff_s <= backoff_max_s")
        for name, limit in (
            ("max_concurrency", max_concurrency),
            ("requests_per_minute", requests_per_minute),
            ("tokens_per_minute", tokens_per_minute),
        ):
            if limit is not None and limit <= 0:
                raise ValueError(f"llm_judge: {name} must be > 0 (or left out for no limit), got {limit}")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.model = model
        self.api_key_env = api_key_env
        self.template = template
        self.system_prompt = system_prompt
        self.verdict_format = verdict_format
        self.score_max = float(score_max)
        self.correct_score = float(correct_score)
        self.wrong_score = float(wrong_score)
        self.correct_threshold = float(correct_threshold)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.strip_thinking = strip_thinking
        self.max_response_chars = int(max_response_chars)
        self.request_timeout_s = float(request_timeout_s)
        self.total_timeout_s = total_timeout_s
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_concurrency = max_concurrency
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._client = None
        if backend == "ray_actor":
            from roll_core.rewards.scorer import checking_options_only
            from workers.rewards.judge.local import LocalJudgeSpec, connected_to_ray, ensure_relay

            self.local = LocalJudgeSpec.from_options(model_path, actor or {})
            # Built in a process connected to Ray (the reward worker's, before it starts its scoring
            # processes), the scorer starts the judge actor and the relay that its scoring processes call; built
            # to check its options (a dry run), it starts nothing.
            if connected_to_ray() and not checking_options_only():
                ensure_relay(self.local)

    def warm_up(self) -> None:
        self._client = self._make_client()
        if self.local is not None:
            self._client.connect()

    def _retry_policy(self):
        from workers.rewards.retry import RetryPolicy

        return RetryPolicy(
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            backoff_max_s=self.backoff_max_s,
            total_timeout_s=self.total_timeout_s,
        )

    def _make_client(self):
        if self.local is not None:
            from workers.rewards.judge.local import LocalChatClient

            return LocalChatClient(self.local, timeout_s=self.request_timeout_s, retry=self._retry_policy())
        from workers.rewards.judge.client import ChatClient
        from workers.rewards.judge.limits import SharedLimits

        api_key = None
        if self.api_key_env is not None:
            api_key = os.environ.get(self.api_key_env)
            if not api_key:
                raise RuntimeError(
                    f"llm_judge: the environment variable {self.api_key_env} (options.api_key_env) is not set"
                )
        limits = SharedLimits.for_endpoint(
            self.base_url,
            self.model,
            max_concurrency=self.max_concurrency,
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
        )
        return ChatClient(
            self.base_url,
            self.model,
            api_key,
            timeout_s=self.request_timeout_s,
            retry=self._retry_policy(),
            limits=limits,
        )

    def messages(self, question: str | None, reference: str, response: str) -> list[dict[str, str]]:
        """The chat messages sent to the judge for one sample."""
        prompt = render_prompt(self.template, question, reference, response)
        head = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*head, {"role": "user", "content": prompt}]

    def score(self, response: str, ground_truth: str, **fields: object) -> RewardResult | None:
        if ground_truth is None or not str(ground_truth).strip():
            logger.warning("llm_judge: empty reference answer, sample %r not scored", fields.get("id"))
            return None
        question = question_of(fields)
        answer = final_answer_text(response or "") if self.strip_thinking else (response or "")
        base_metrics = {"question_given": float(question is not None)}
        if answer is None or not answer.strip():
            return RewardResult(
                score=self.wrong_score, correct=False, metrics={**base_metrics, "answer_found": 0.0}
            )
        answer = answer.strip()[-self.max_response_chars :]
        if self._client is None:
            self._client = self._make_client()
        started = time.monotonic()
        reply = self._client.chat(
            self.messages(question, str(ground_truth).strip(), answer),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        verdict = parse_verdict(reply.text, self.verdict_format, self.score_max)
        if verdict is None:
            raise JudgeVerdictUnparseable(
                f"llm_judge: no {self.verdict_format} verdict in the judge's reply {reply.text[:300]!r}"
            )
        return RewardResult(
            score=self.wrong_score + verdict * (self.correct_score - self.wrong_score),
            correct=verdict >= self.correct_threshold,
            metrics={
                **base_metrics,
                "answer_found": 1.0,
                "judge_verdict": verdict,
                "judge_attempts": float(reply.attempts),
                "judge_latency_s": time.monotonic() - started,
            },
        )
