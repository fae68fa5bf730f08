"""Why the judge gave no verdict for a sample: each of these makes the reward worker mask the sample (never
score it 0). Raised by the HTTP client and the judge actor, and by ``workers.rewards.llm_judge`` itself."""

from __future__ import annotations


class JudgeError(RuntimeError):
    """The judge gave no verdict for a sample; the reward worker masks the sample (never scores it 0)."""

    #: Short name of the failure, for logs and counts.
    reason = "judge_error"


class JudgeUnreachable(JudgeError):
    """No answer from the judge: connection failed, timed out or 5xx, on every attempt."""

    reason = "judge_unreachable"


class JudgeRejected(JudgeError):
    """The judge refused the request with a 4xx status (bad key, unknown model, prompt too long); not
    retried."""

    reason = "judge_rejected"


class JudgeVerdictUnparseable(JudgeError):
    """The judge answered, but its reply holds no verdict in the declared format."""

    reason = "judge_parse_failed"
