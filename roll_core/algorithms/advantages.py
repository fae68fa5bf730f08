"""Advantage estimators, each (batch tensors) -> (advantages, returns), all (B, R) and zero under the mask.

Every estimator takes the same keyword arguments (the pipeline passes them all; each uses what it needs):
`token_level_rewards` (B, R), `response_mask` (B, R), `group_ids` (B,), `in_loss` (B,) (1: the sample is in
the loss; 0: it is left out of every statistic), `values` (B, R) or None, `gamma`, `lambd`.
"""

from __future__ import annotations

import torch

from roll_core.registry import register_advantage


def place_at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R) rewards that are zero except at each response's last valid token (the last the model
    sampled: a multi-turn response's mask has holes where tools wrote)."""
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    if response_mask.shape[1] == 0:
        return rewards
    positions = torch.arange(response_mask.shape[1]).expand_as(response_mask)
    last = torch.where(response_mask > 0, positions, -1).max(1).values
    has_tokens = last >= 0
    rows = torch.arange(len(scores))[has_tokens]
    rewards[rows, last[has_tokens]] = scores[has_tokens]
    return rewards


def _valid(in_loss: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.ones(like.shape[0], dtype=like.dtype) if in_loss is None else in_loss.to(like.dtype)


def group_statistics(
    values: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample (B,): its group's mean, unbiased std and count over the samples where `valid` is 1."""
    # inverse numbers the groups 0..G-1, each used: bincount's sums have one entry per group
    _, inverse = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(inverse, weights=valid)
    mean = torch.bincount(inverse, weights=values * valid) / count.clamp(min=1.0)
    sq = torch.bincount(inverse, weights=(values - mean[inverse]).square() * valid)
    std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()
    return mean[inverse], std[inverse], count[inverse]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) with the mean and unbiased variance over the tokens where `mask` is 1;
    zero under the mask."""
    count = mask.sum().clamp(min=1.0)
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / (count - 1.0).clamp(min=1.0)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def _returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards * response_mask).sum(1)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = per_sample.unsqueeze(1) * response_mask
    return advantages, advantages.clone()


@register_advantage("grpo", group_baseline=True)
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    eps: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (Shao et al., DeepSeekMath, arXiv:2402.03300).

    Each response's return is its summed reward; its advantage is (return - group mean) / (group std + eps),
    with the unbiased std over the group's samples whose `in_loss` is 1, broadcast over its valid tokens.
    A group of one valid sample gets advantage 0.
    """
    valid = _valid(in_loss, token_level_rewards)
    returns = _returns(token_level_rewards, response_mask)
    mean, std, count = group_statistics(returns, group_ids, valid)
    scaled = torch.where(count > 1, (returns - mean) / (std + eps), torch.zeros_like(returns))
    return _broadcast(scaled * valid, response_mask)


@register_advantage("dr_grpo", group_baseline=True)
def dr_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training", arXiv:2503.20783): return - group mean, with
    no division by the group's std (which over-weights groups that are nearly all right or all wrong). Pair it
    with loss_agg_mode seq-mean-token-sum-norm, the paper's other half. A group of one valid sample gets 0."""
    valid = _valid(in_loss, token_level_rewards)
    returns = _returns(token_level_rewards, response_mask)
    mean, _, count = group_statistics(returns, group_ids, valid)
    centred = torch.where(count > 1, returns - mean, torch.zeros_like(returns))
    return _broadcast(centred * valid, response_mask)


@register_advantage("rloo", group_baseline=True)
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al., "Back to Basics", arXiv:2402.14740; Kool et al. 2019): a
    response's baseline is the mean return of the *other* valid responses of its group, which equals
    n / (n - 1) * (return - group mean). A group of one valid sample gets 0."""
    valid = _valid(in_loss, token_level_rewards)
    returns = _returns(token_level_rewards, response_mask)
    mean, _, count = group_statistics(returns, group_ids, valid)
    loo = torch.where(count > 1, count / (count - 1.0).clamp(min=1.0) * (returns - mean), torch.zeros_like(returns))
    return _broadcast(loo * valid, response_mask)


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """(B, R) sum of the discounted rewards from each valid token to the end of its response."""
    rewards = token_level_rewards * response_mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running * response_mask[:, t]
        returns[:, t] = running
    return returns * response_mask


@register_advantage("reinforce")
def reinforce_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    *,
    gamma: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams, 1992): each token's discounted return as its advantage, with no baseline and no
    whitening of its own (ROLL's `reinforce`; pair it with reward_shaping's normalisation or whiten_advantages).
    With group-normalised rewards (norm_mean_type and norm_std_type `group`) it is ROLL's `grpo`."""
    valid = _valid(in_loss, token_level_rewards)
    mask = response_mask * valid.unsqueeze(1)
    returns = discounted_returns(token_level_rewards, response_mask, gamma) * mask
    return returns, returns.clone()


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    *,
    gamma: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, arXiv:2501.03262): each token's discounted return (a token-level KL penalty in the
    rewards makes it differ from token to token), whitened over every valid token of the batch (global
    advantage normalisation, no critic, no group baseline). Returns are the discounted returns."""
    valid = _valid(in_loss, token_level_rewards)
    mask = response_mask * valid.unsqueeze(1)
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, mask), returns * mask


@register_advantage("reinforce_plus_plus_baseline", group_baseline=True)
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    in_loss: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu, arXiv:2501.03262, v3+): return - group mean (the group baseline), broadcast over
    the response, then whitened over every valid token of the batch."""
    valid = _valid(in_loss, token_level_rewards)
    mask = response_mask * valid.unsqueeze(1)
    returns = _returns(token_level_rewards, response_mask)
    mean, _, _ = group_statistics(returns, group_ids, valid)
    centred = (returns - mean).unsqueeze(1).expand_as(mask)
    advantages = masked_whiten(centred, mask)
    return advantages, advantages.clone()


@register_advantage("gae", needs_critic=True)
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lambd: float,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438) over each response's valid tokens.

    The value after a response's last valid token is 0 (the episode ends there). Returns are advantages + values.
    Rewards and values on padding are never read: a padded position passes the running values through.
    """
    advantages = torch.zeros_like(token_level_rewards)
    next_adv = torch.zeros(advantages.shape[0], dtype=advantages.dtype)
    next_value = torch.zeros(advantages.shape[0], dtype=advantages.dtype)
    for t in reversed(range(advantages.shape[1])):
        valid = response_mask[:, t].bool()
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lambd * next_adv
        next_adv = torch.where(valid, adv, next_adv)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, adv, torch.zeros_like(adv))
    returns = (advantages + values) * response_mask
    return advantages, returns


def postprocess_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, whiten: bool = False, clip: float | None = None
) -> torch.Tensor:
    """Optional whitening over the valid tokens of the batch (`masked_whiten`; PPO implementation practice,
    Huang et al., "The 37 implementation details of PPO", 2022), then clipping to [-clip, clip]."""
    if whiten:
        advantages = masked_whiten(advantages, mask)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages * mask


def advantage_metrics(advantages: torch.Tensor, mask: torch.Tensor, domains: list[str]) -> dict[str, float]:
    """`advantages/<domain>/{mean,std,abs_max}` over each domain's tokens in the loss (and `all`), the statistics
    that advantage_scope and whitening act on."""
    metrics: dict[str, float] = {}
    groups = {"all": list(range(len(domains)))}
    for i, domain in enumerate(domains):
        groups.setdefault(domain, []).append(i)
    for name, rows in groups.items():
        values = advantages[rows][mask[rows] > 0].double()
        if values.numel() == 0:
            continue
        metrics[f"advantages/{name}/mean"] = float(values.mean())
        metrics[f"advantages/{name}/std"] = float(values.std()) if values.numel() > 1 else 0.0
        metrics[f"advantages/{name}/abs_max"] = float(values.abs().max())
    return metrics
