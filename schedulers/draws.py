"""Where a domain's prompts come from: the seeded walk over its rows (PromptSampler, checkpointed with the
scheduler) and the sampling seed of a deterministic run's requests (request_seed)."""

from __future__ import annotations

import hashlib

import numpy as np


class PromptSampler:
    """Walks a domain's rows in a seeded shuffled order, epoch after epoch; its position is checkpointable."""

    def __init__(self, size: int, seed: int) -> None:
        if size == 0:
            raise ValueError("a domain with no rows cannot be sampled")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            n = min(k - len(out), self.size - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + n])
            self.position += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["seed"], state["size"]) != (self.seed, self.size):
            raise ValueError(
                f"sampler state is for seed {state['seed']} over {state['size']} rows, "
                f"not seed {self.seed} over {self.size} rows: the data or the seed changed"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


def request_seed(seed: int, domain: str, call: int, draw: int | str) -> int:
    """The sampling seed of one request: a stable hash, the same in every process and on every run."""
    digest = hashlib.blake2b(f"{seed}/{domain}/{call}/{draw}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)

