"""How a step's prompts are divided among the domains."""

from __future__ import annotations

from collections.abc import Mapping


def domain_shares(probs: Mapping[str, float], total: int) -> dict[str, int]:
    """Split `total` prompts by `probs` with the largest-remainder rule.

    Each domain first gets floor(p * total); the prompts left over go one each to the domains with the largest
    fractional parts, ties broken by the order of domain_interleave_probs. The result sums to `total` and does
    not depend on anything but its arguments.
    """
    exact = {d: p * total for d, p in probs.items()}
    shares = {d: int(x + 1e-9) for d, x in exact.items()}
    left = total - sum(shares.values())
    order = sorted(probs, key=lambda d: -(exact[d] - shares[d]))
    for d in order[:left]:
        shares[d] += 1
    return shares
