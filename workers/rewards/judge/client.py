"""A small client for ``POST /v1/chat/completions`` of an OpenAI-compatible server, with retries by
``workers.rewards.retry`` (a failed connection, a timeout, 5xx, 408, 429; never another 4xx: a bad key, an
unknown model, a prompt too long would fail the same way again)."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests

from workers.rewards.judge.errors import JudgeRejected, JudgeUnreachable, JudgeVerdictUnparseable
from workers.rewards.judge.limits import SharedLimits
from workers.rewards.retry import RetryPolicy, is_retried_status

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatReply:
    text: str
    #: HTTP requests it took (1 when the first succeeded).
    attempts: int
    total_tokens: int | None


def estimate_tokens(messages: list[dict[str, str]], max_tokens: int) -> int:
    """Tokens a request may use, before it is sent: about 4 characters a prompt token, plus the reply's
    budget."""
    chars = sum(len(m.get("content") or "") for m in messages)
    return math.ceil(chars / 4) + max_tokens


def _retry_after(response: requests.Response) -> float | None:
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


class ChatClient:
    """One judge endpoint: ``chat(messages)`` returns the reply's text or raises a ``JudgeError``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        timeout_s: float,
        retry: RetryPolicy,
        limits: SharedLimits | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout_s = timeout_s
        self.retry = retry
        self.limits = limits
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._session = requests.Session()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int, temperature: float = 0.0) -> ChatReply:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        estimate = estimate_tokens(messages, max_tokens)
        started = time.monotonic()
        failure, retry_after = "", None
        attempts = 0
        for attempt in range(self.retry.max_retries + 1):
            if attempt:
                wait = self.retry.delay(attempt, self._rng, retry_after)
                if self._past_deadline(started, wait):
                    break
                self._sleep(wait)
            attempts += 1
            try:
                response = self._post(body, estimate)
            except requests.Timeout:
                failure, retry_after = f"no reply within {self.timeout_s:g}s", None
                continue
            except requests.ConnectionError as err:
                failure, retry_after = f"connection failed: {err}", None
                continue
            if response.status_code == 200:
                return self._reply(response, attempts, estimate)
            detail = f"HTTP {response.status_code}: {response.text[:300]}"
            if not is_retried_status(response.status_code):
                raise JudgeRejected(f"llm_judge: the judge at {self.url} refused the request ({detail})")
            failure, retry_after = detail, _retry_after(response)
            logger.info("llm_judge: attempt %d at %s failed (%s)", attempts, self.url, detail)
        raise JudgeUnreachable(
            f"llm_judge: no reply from the judge at {self.url} after {attempts} attempt(s) "
            f"in {time.monotonic() - started:.1f}s; last: {failure}"
        )

    def _past_deadline(self, started: float, wait: float) -> bool:
        total = self.retry.total_timeout_s
        return total is not None and time.monotonic() - started + wait >= total

    def _post(self, body: dict, estimate: int) -> requests.Response:
        if self.limits is None:
            return self._session.post(self.url, json=body, headers=self._headers, timeout=self.timeout_s)
        with self.limits.slot():
            self.limits.wait_for_rate(estimate)
            return self._session.post(self.url, json=body, headers=self._headers, timeout=self.timeout_s)

    def _reply(self, response: requests.Response, attempts: int, estimate: int) -> ChatReply:
        try:
            payload = response.json()
            text = payload["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise JudgeVerdictUnparseable(
                f"llm_judge: the judge's answer is not a chat completion ({err!r}): {response.text[:300]!r}"
            ) from None
        usage = payload.get("usage") or {}
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        total = total if isinstance(total, int) else None
        if self.limits is not None and total is not None:
            self.limits.settle_tokens(estimate, total)
        return ChatReply(text=text if isinstance(text, str) else "", attempts=attempts, total_tokens=total)
