"""Inter-annotator agreement: Kendall's τ-b between two annotators' judgements of the same item.

A ranking scores its candidates by rank (best highest), a rating by its value; τ-b accounts for ties (equal
ratings), so rankings and ratings compare on one scale. For each pair of annotators the per-item τ values of
the items both judged completely are averaged; items where either judgement is constant (τ undefined) are
left out and counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float | None:
    """τ-b = (C − D) / √((n₀ − n₁)(n₀ − n₂)) over the n₀ = n(n−1)/2 pairs (n₁, n₂: pairs tied in x, in y).

    None when undefined (fewer than two values, or either side constant). O(n²): n is K candidates.
    """
    if len(x) != len(y):
        raise ValueError(f"kendall_tau_b: {len(x)} vs {len(y)} values")
    concordant = discordant = ties_x = ties_y = 0
    for i, j in combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0:
            ties_x += 1
        if dy == 0:
            ties_y += 1
        if dx * dy > 0:
            concordant += 1
        elif dx * dy < 0:
            discordant += 1
    n0 = len(x) * (len(x) - 1) // 2
    denominator = math.sqrt((n0 - ties_x) * (n0 - ties_y))
    return (concordant - discordant) / denominator if denominator > 0 else None


@dataclass(frozen=True, slots=True)
class PairAgreement:
    annotator_a: str
    annotator_b: str
    items: int
    """Items both judged completely with a defined τ."""
    mean_tau: float | None
    undefined: int
    """Shared items left out because one judgement was constant."""


@dataclass(frozen=True, slots=True)
class AgreementReport:
    pairs: list[PairAgreement]
    mean_tau: float | None
    """Mean of every (annotator pair, shared item) τ."""
    comparisons: int
    """How many such τ values the mean is over."""


def agreement(judgements: Mapping[int, Mapping[str, Mapping[int, float]]]) -> AgreementReport:
    """Pairwise Kendall τ-b; ``judgements``: item id → annotator → candidate id → score (higher is better).

    Two annotators are compared on the candidates both scored (at least two).
    """
    taus: dict[tuple[str, str], list[float]] = {}
    undefined: dict[tuple[str, str], int] = {}
    for by_annotator in judgements.values():
        for a, b in combinations(sorted(by_annotator), 2):
            shared = sorted(set(by_annotator[a]) & set(by_annotator[b]))
            if len(shared) < 2:
                continue
            tau = kendall_tau_b([by_annotator[a][c] for c in shared], [by_annotator[b][c] for c in shared])
            if tau is None:
                undefined[(a, b)] = undefined.get((a, b), 0) + 1
            else:
                taus.setdefault((a, b), []).append(tau)
    pairs = [PairAgreement(a, b, len(taus.get((a, b), [])),
                           sum(taus[(a, b)]) / len(taus[(a, b)]) if taus.get((a, b)) else None,
                           undefined.get((a, b), 0))
             for a, b in sorted(set(taus) | set(undefined))]
    every = [t for values in taus.values() for t in values]
    return AgreementReport(pairs, sum(every) / len(every) if every else None, len(every))
