"""The distribution responses are sampled from (temperature, top-k, top-p), as the losses must see it.

Generation draws each token from softmax(logits / temperature) restricted to the top-k tokens and then to the
smallest set whose mass reaches top-p. The PPO ratio, the off-policy weights and the KL all compare log-probs of
sampled tokens, so they must be log-probs under that same restricted distribution: the full softmax would give
mass to tokens the sampler can never draw, and the ratio of a sampled token would be off by the mass outside the
kept set. `SamplingDistribution.log_probs` applies the restriction with transformers' own logits warpers, the ones
`generate` uses (vLLM applies the same rule: temperature, then top-k, then top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OUTSIDE_LOG_PROB = -30.0
"""Log-prob given to a token outside the kept set. The policy that sampled a token always kept it, but after an
update (or under the reference model) it may not: -inf there would turn the ratio's exp and the KL into inf or NaN,
so such a token is floored here (probability ~1e-13) and passes no gradient."""


@dataclass(frozen=True)
class SamplingDistribution:
    temperature: float = 1.0
    top_k: int = 0
    """0: no top-k restriction."""
    top_p: float = 1.0
    """1.0: no top-p restriction."""

    @classmethod
    def of(cls, generating_args) -> SamplingDistribution:
        """The distribution of a `GeneratingArgs` (greedy decoding keeps only its temperature: there is no
        sampling distribution to match, and the log-probs stay those of the tempered policy)."""
        if not generating_args.do_sample:
            return cls(temperature=generating_args.temperature)
        return cls(generating_args.temperature, generating_args.top_k, generating_args.top_p)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def kept(self, scaled_logits: torch.Tensor) -> torch.Tensor:
        """Boolean mask (..., V) of the tokens the sampler can draw, given temperature-scaled logits (..., V)."""
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        flat = scaled_logits.detach().reshape(-1, scaled_logits.shape[-1])
        if self.top_k > 0:
            flat = TopKLogitsWarper(top_k=self.top_k)(None, flat)
        if self.top_p < 1.0:
            flat = TopPLogitsWarper(top_p=self.top_p)(None, flat)
        return torch.isfinite(flat).reshape(scaled_logits.shape)

    def log_probs(
        self, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, R) of `tokens` under this distribution given logits (B, R, V), and optionally its
        entropies (B, R). With `entropy_grad=False` the entropies are computed outside the autograd graph (for
        logging only): the graph then keeps no (B, R, V) product for the backward pass."""
        scaled = logits.float() / self.temperature
        kept = None
        if self.truncates:
            kept = self.kept(scaled)
            scaled = scaled.masked_fill(~kept, float("-inf"))
        logp_all = torch.log_softmax(scaled, dim=-1)
        log_probs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if kept is not None:
            log_probs = log_probs.clamp(min=OUTSIDE_LOG_PROB)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                finite = logp_all if kept is None else logp_all.masked_fill(~kept, 0.0)
                entropy = -(logp_all.exp() * finite).sum(-1)
        return log_probs, entropy
