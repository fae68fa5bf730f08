"""The difficulty ledger: which rows of a domain gave uniform groups lately, so they can be passed over before
any generation is spent on them.

A group whose responses are all right or all wrong has no spread for a group-relative advantage to learn from
(GRPO's advantages are all zero; the `std_filter` drops it and the scheduler draws again). Per row the ledger
keeps a signed streak: +n after n all-right groups in a row, -n after n all-wrong ones, 0 after a mixed group (or
never seen). A row whose streak has reached `streak` (either sign) is skipped when drawn, unless a re-test draw
(probability `retest_prob`) lets it through: a row the policy has since learned, or forgotten, comes back, and
its next group resets or extends the streak. Masked responses are left out; a group with none scored says
nothing. The draws are a hash of the run's seed, the domain, the step's call and a counter, so deterministic runs
stay deterministic, and the state (the streaks) is checkpointed with the scheduler.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


class DifficultyLedger:
    def __init__(self, size: int, *, streak: int, retest_prob: float, seed: int, domain: str) -> None:
        self.size, self.streak, self.retest_prob = size, streak, retest_prob
        self.seed, self.domain = seed, domain
        self.streaks: dict[int, int] = {}

    def record(self, index: int, correct: Sequence[bool | None]) -> None:
        """A scored group of row ``index``: its responses' verdicts (None: masked)."""
        scored = [bool(c) for c in correct if c is not None]
        if not scored:
            return
        before = self.streaks.get(index, 0)
        if all(scored):
            now = before + 1 if before > 0 else 1
        elif not any(scored):
            now = before - 1 if before < 0 else -1
        else:
            now = 0
        if now:
            self.streaks[index] = now
        else:
            self.streaks.pop(index, None)

    def uniform(self, index: int) -> bool:
        """Whether the row's recent groups were uniform often enough to skip it."""
        return abs(self.streaks.get(index, 0)) >= self.streak

    def skip(self, index: int, call: int, check: int) -> bool:
        """Whether to pass over row ``index``, drawn as the ``check``-th draw of step ``call``."""
        return self.uniform(index) and self._draw(call, check) >= self.retest_prob

    def _draw(self, call: int, check: int) -> float:
        digest = hashlib.blake2b(f"{self.seed}/{self.domain}/ledger/{call}/{check}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64

    def uniform_rows(self) -> int:
        return sum(1 for s in self.streaks.values() if abs(s) >= self.streak)

    def state_dict(self) -> dict:
        return {"size": self.size, "streaks": {str(k): v for k, v in self.streaks.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != self.size:
            raise ValueError(f"ledger state is for {state['size']} rows, not {self.size}: the data changed")
        self.streaks = {int(k): int(v) for k, v in state["streaks"].items()}
