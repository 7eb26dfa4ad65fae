"""Minimum-Bayes-risk choice over a candidate pool (docs/design.md, "Minimum-Bayes-risk decoding").

A utility u(h, r) scores candidate h against the pseudo-reference r; the choice is the candidate of highest
expected utility, ties to the lower index. Two estimates of the expectation, by ``weights`` (the two rerank
``mbr_weights``):

- ``uniform`` (a sampled pool, a Monte-Carlo estimate): the pool e_1..e_N as drawn, duplicates as separate
  entries, each candidate against the *other* entries (leave-one-out: a candidate is no evidence for itself),

      E(e_i) = Σ_{j≠i} u(e_i, e_j) / (N − 1)          (0 for a pool of one entry).

  Pools come deduplicated (``rlt2t predict`` keeps one entry per text, in order of first appearance) with
  ``counts[k]``, the entries text k stands for: E of a text with k copies counts its other k − 1 copies at
  u(c, c), so a text sampled three times weighs three times; the distinct texts cost D², not N².
- ``probability`` (model-weighted): over the distinct texts y of the pool with their normalised sequence
  probabilities p(y) = exp(log p(y | x)) / Σ_y' exp(log p(y' | x)),

      E(h) = Σ_y p(y) · u(h, y)                       (h itself included, each text once: no counts),

  the pool standing for the model's distribution. A text's probability already says how likely it is: counting
  its copies too would count that twice.

The utility matrix U[i, j] = u(c_i, [c_j]) of the n-gram metrics is computed from count matrices, never one
Python call per pair: for integer counts, Σ_g min(a_g, b_g) = Σ_{t >= 1} Σ_g [a_g >= t]·[b_g >= t], a sum of
matrix products of 0/1 indicator matrices, pass t over the n-grams some text holds t times or more.
:class:`BleuUtility` (BLEU-4 and SacreBLEU: sacrebleu's sentence statistics and formula, smoothing and effective
order included), :class:`CiderDUtility` (coco-caption's CIDEr-D with given document frequencies) and
:class:`TaskScoreUtility` equal their metric's ``per_sample`` pair by pair (tests/unit/common/test_mbr.py): the
:data:`VECTORISED_METRICS`. Any other registered metric (:class:`MetricUtility`) or a reward with references
(:class:`RewardUtility`) is scored in one batched call over the N² ordered pairs. A utility must read its
reference (:func:`metric_utility` refuses one that does not): against a reference it ignores, every candidate's
expected utility is its own score.

Pools are capped (:func:`check_pool_size`): the work grows with the square of the pool.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from sacrebleu.metrics import BLEU

from rlt2t.common.metrics import (
    CIDER_MAX_ORDER,
    Bleu4,
    CiderD,
    DocumentFrequency,
    Metric,
    SacreBleu,
    TaskScore,
    get_metric,
)
from rlt2t.common.rewards import Reward

_LOG_ZERO = -9999999999.0
"""sacrebleu's ``my_log(0)``: a zero precision makes BLEU 0 without smoothing."""


@runtime_checkable
class PairUtility(Protocol):
    """u(c_i, [c_j]) for every ordered pair of a pool."""

    name: str

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        """U[i, j] = u(candidates[i], [candidates[j]]), float64 [N, N]. ``source``: the pool's source (rewards)."""
        ...


def check_pool_size(size: int, cap: int, key: str, where: str = "") -> None:
    """ValueError naming ``key`` when a pool of ``size`` entries is over ``cap``: MBR scores size² pairs."""
    if size > cap:
        raise ValueError(f"MBR pool of {size} candidates{where} is over {key}={cap}: MBR scores every pair "
                         f"({size}² = {size * size} utilities per source); shrink the pool (fewer beams, hypotheses "
                         f"or samples) or raise {key}")


def expected_utility(utility: np.ndarray, weights: np.ndarray | None = None,
                     counts: np.ndarray | None = None) -> np.ndarray:
    """E(c_i) of every distinct candidate, float64 [D] (the module docstring's two estimates).

    ``utility``: U[i, j] = u(c_i, [c_j]) [D, D]. ``weights`` None: uniform, leave-one-out over the entries, text j
    standing for ``counts[j]`` of them (None: one each); a pool of a single entry has no other candidate to agree
    with: E = 0. ``weights`` given: the model-weighted expectation Σ_j p_j U[i, j] / Σ_j p_j over the distinct
    texts, j = i included (p_j >= 0 on any scale, some > 0: a probability that underflowed to 0 is a weight of
    0); it takes no ``counts``.
    """
    u = np.asarray(utility, dtype=np.float64)
    d = u.shape[0]
    if u.ndim != 2 or u.shape != (d, d):
        raise ValueError(f"utility must be a square matrix, got shape {u.shape}")
    if weights is not None:
        if counts is not None:
            raise ValueError("probability weights take no counts: each distinct text counts once, at its "
                             "probability (uniform weights count duplicates)")
        p = np.asarray(weights, dtype=np.float64)
        if p.shape != (d,):
            raise ValueError(f"weights need one entry per candidate ({d}), got {p.shape}")
        if not (np.all(np.isfinite(p)) and np.all(p >= 0) and p.sum() > 0):
            raise ValueError("weights must be finite and >= 0, at least one > 0")
        return (u @ p) / p.sum()
    m = np.ones(d) if counts is None else np.asarray(counts, dtype=np.float64)
    if m.shape != (d,):
        raise ValueError(f"counts need one entry per candidate ({d}), got {m.shape}")
    if np.any(m < 1):
        raise ValueError("counts must be >= 1")
    # Σ over the entries j ≠ i: every entry of the other texts, and the other m_i - 1 copies of i itself at U[i, i].
    numerator = (u * np.where(np.eye(d, dtype=bool), 0.0, m)).sum(1) + (m - 1.0) * np.diag(u)
    denominator = m.sum() - 1.0
    return numerator / denominator if denominator > 0 else np.zeros(d)


def probability_weights(total_logprobs: Sequence[float]) -> np.ndarray:
    """Normalised sequence probabilities from total log-probs (softmax; float64 [N], sums to 1). A candidate more
    than ~745 nats below the best underflows to a weight of exactly 0, which :func:`expected_utility` accepts."""
    lp = np.asarray(total_logprobs, dtype=np.float64)
    if lp.size == 0 or not np.all(np.isfinite(lp)):
        raise ValueError("total log-probs must be finite, at least one")
    w = np.exp(lp - lp.max())  # the best is exp(0) = 1: the sum is >= 1
    return w / w.sum()


def mbr_choice(utility: np.ndarray, weights: np.ndarray | None = None,
               counts: np.ndarray | None = None) -> tuple[int, np.ndarray]:
    """(argmax of :func:`expected_utility`, ties to the lower index; the expected utilities)."""
    scores = expected_utility(utility, weights, counts)
    return int(np.argmax(scores)), scores


def mbr_over_entries(entries: Sequence[str], utility: PairUtility, total_logprobs: Sequence[float] | None = None,
                     source: str = "") -> tuple[int, np.ndarray]:
    """MBR over a pool given entry by entry, duplicates included (what a sampler returns): the utility is computed
    over the distinct texts once. ``total_logprobs``: each entry's sequence log-prob, for the model-weighted
    expectation (a text's probability is its first entry's; its copies differ by rounding only); None: uniform,
    leave-one-out over the entries. Returns (the chosen entry: the first of the chosen text, each entry's expected
    utility [N])."""
    if not entries:
        raise ValueError("entries is empty")
    texts = list(dict.fromkeys(entries))
    index = {t: k for k, t in enumerate(texts)}
    of_entry = np.array([index[e] for e in entries])
    if total_logprobs is None:
        best, scores = mbr_choice(utility.matrix(texts, source), counts=np.bincount(of_entry, minlength=len(texts)))
    else:
        if len(total_logprobs) != len(entries):
            raise ValueError(f"{len(total_logprobs)} log-probs for {len(entries)} entries")
        first = [entries.index(t) for t in texts]
        weights = probability_weights([total_logprobs[i] for i in first])
        best, scores = mbr_choice(utility.matrix(texts, source), weights)
    return int(np.flatnonzero(of_entry == best)[0]), scores[of_entry]


# -- n-gram statistics -----------------------------------------------------------------------------


def _count_matrices(token_lists: Sequence[Sequence[str]], max_order: int) -> list[tuple[np.ndarray, list[tuple]]]:
    """Per order n = 1..max_order: (counts [N, G_n] float64 of every n-gram of the pool, the n-grams)."""
    out = []
    for n in range(1, max_order + 1):
        per_text = [Counter(zip(*(tokens[k:] for k in range(n)), strict=False)) for tokens in token_lists]
        vocab: dict[tuple, int] = {}
        for c in per_text:
            for g in c:
                vocab.setdefault(g, len(vocab))
        counts = np.zeros((len(token_lists), len(vocab)))
        for i, c in enumerate(per_text):
            if c:
                counts[i, [vocab[g] for g in c]] = list(c.values())
        out.append((counts, list(vocab)))
    return out


def _clipped(counts: np.ndarray, right: np.ndarray | None = None) -> np.ndarray:
    """M[i, j] = Σ_g min(counts[i, g], counts[j, g]) · right[j, g] (right None: 1), float64 [N, N].

    Integer counts: min(a, b) = Σ_{t >= 1} [a >= t][b >= t], so M is a sum of matrix products. Pass t only needs the
    n-grams some text holds at least t times: after the first pass the columns shrink to those, so one degenerate
    text ("7 7 7 ..." 64 times) costs a few one-column products, not 64 products over the whole vocabulary."""
    n = counts.shape[0]
    out = np.zeros((n, n))
    if counts.size == 0:
        return out
    above = (counts >= 1).astype(np.float64)
    out += above @ (above if right is None else above * right).T
    cols = np.flatnonzero(counts.max(0) >= 2)
    t = 2
    while cols.size:
        part = counts[:, cols]
        above = (part >= t).astype(np.float64)
        out += above @ (above if right is None else above * right[:, cols]).T
        t += 1
        cols = cols[part.max(0) >= t]
    return out


class BleuUtility:
    """Sentence BLEU of c_i against the single reference c_j, as a sacrebleu ``BLEU`` object computes it
    (its tokenizer, lowercasing, n-gram order, smoothing and effective order), / 100: what :class:`Bleu4`
    (``bleu4``) and :class:`SacreBleu` (``sacrebleu``) give per sample."""

    def __init__(self, bleu: BLEU, name: str = "bleu4"):
        self.bleu, self.name = bleu, name

    @classmethod
    def of(cls, metric: Bleu4 | SacreBleu) -> BleuUtility:
        """The utility of a registered BLEU metric (the sacrebleu object its ``per_sample`` uses)."""
        if isinstance(metric, Bleu4):
            return cls(metric._bleu, metric.name)
        return cls(metric._sentence_bleu, metric.name)

    def _tokens(self, text: str) -> list[str]:
        if self.bleu.lowercase:
            text = text.lower()
        return self.bleu.tokenizer(text.rstrip()).split()

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        tokens = [self._tokens(c) for c in candidates]
        order = self.bleu.max_ngram_order
        lengths = np.array([len(t) for t in tokens], dtype=np.float64)
        n = len(tokens)
        correct = np.stack([_clipped(c) for c, _ in _count_matrices(tokens, order)], axis=-1)  # [N, N, order]
        total = np.broadcast_to(np.stack([np.maximum(lengths - k, 0.0) for k in range(order)], axis=-1)[:, None, :],
                                (n, n, order)).copy()
        sys_len, ref_len = lengths[:, None], lengths[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            bp = np.where(sys_len < ref_len, np.where(sys_len > 0, np.exp(1.0 - ref_len / sys_len), 0.0), 1.0)
        any_match = correct.sum(-1) > 0  # checked before add-k smoothing, as sacrebleu does
        method = self.bleu.smooth_method
        value = float(self.bleu.smooth_value if self.bleu.smooth_value is not None else BLEU.SMOOTH_DEFAULTS[method]
                      or 0.0)
        precisions = np.zeros((n, n, order))
        alive = np.ones((n, n), dtype=bool)  # sacrebleu's loop has not hit an order without n-grams yet
        eff = np.full((n, n), float(order))
        mteval = np.ones((n, n))
        for k in range(order):
            if method == "add-k" and k > 0:
                correct[..., k] += value
                total[..., k] += value
            alive &= total[..., k] > 0
            if self.bleu.effective_order:
                eff = np.where(alive, k + 1.0, eff)
            zero = alive & (correct[..., k] == 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                p = np.where(alive & ~zero, 100.0 * correct[..., k] / total[..., k], 0.0)
                if method == "exp":
                    mteval = np.where(zero, mteval * 2.0, mteval)
                    p = np.where(zero, 100.0 / (mteval * total[..., k]), p)
                elif method == "floor":
                    p = np.where(zero, 100.0 * value / total[..., k], p)
            precisions[..., k] = p
        with np.errstate(divide="ignore"):
            logs = np.where(precisions > 0, np.log(np.where(precisions > 0, precisions, 1.0)), _LOG_ZERO)
        used = np.arange(order)[None, None, :] < eff[..., None]
        score = bp * np.exp((logs * used).sum(-1) / eff)
        return np.where(any_match, score, 0.0) / 100.0


class CiderDUtility:
    """CIDEr-D of c_i against the single reference c_j (coco-caption's, as :class:`CiderD` computes it) with
    document frequencies ``df`` (the training references'); None: the pool's distinct candidates are the
    reference sets."""

    name = "cider_d"

    def __init__(self, sigma: float = 6.0, df: DocumentFrequency | None = None):
        self.sigma, self.df = float(sigma), df

    @classmethod
    def of(cls, metric: CiderD) -> CiderDUtility:
        return cls(metric.sigma, metric.df)

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        tokens = [c.split() for c in candidates]
        df = self.df or DocumentFrequency.from_references([[c] for c in dict.fromkeys(candidates)])
        n = len(tokens)
        # CIDEr-D's "length" is the number of bigrams (see metrics._TfIdf).
        length = np.array([max(len(t) - 1, 0) for t in tokens], dtype=np.float64)
        delta = length[:, None] - length[None, :]
        penalty = np.exp(-(delta * delta) / (2.0 * self.sigma * self.sigma))
        total = np.zeros((n, n))
        for counts, grams in _count_matrices(tokens, CIDER_MAX_ORDER):
            idf = np.array([df.idf.get(g, df.log_num_ref_sets) for g in grams])
            weights = counts * idf  # tf-idf vectors, raw count as tf
            norms = np.sqrt((weights * weights).sum(-1))
            # Σ_g min(w_i, w_j)·w_j = Σ_g min(c_i, c_j)·c_j·idf² (idf >= 0).
            sim = _clipped(counts, counts * idf * idf)
            scale = norms[:, None] * norms[None, :]
            sim = np.divide(sim, scale, out=sim.copy(), where=scale != 0.0)
            total += sim * penalty
        return total / CIDER_MAX_ORDER * 10.0


class TaskScoreUtility:
    """(1 - w)·CIDEr-D + w·BLEU-4 of c_i against [c_j], as :class:`TaskScore` scores a sample."""

    name = "task_score"

    def __init__(self, metric: TaskScore):
        self.weight = metric.bleu_weight
        self.cider, self.bleu = CiderDUtility.of(metric.cider), BleuUtility.of(metric.bleu)

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        n = len(candidates)
        out = np.zeros((n, n))
        if self.weight < 1.0:
            out += (1.0 - self.weight) * self.cider.matrix(candidates)
        if self.weight > 0.0:
            out += self.weight * self.bleu.matrix(candidates)
        return out


def _ordered_pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = np.divmod(np.arange(n * n), n)
    return rows, cols


class MetricUtility:
    """Any registered metric: one ``per_sample`` call over the N² ordered pairs (c_i, [c_j])."""

    def __init__(self, metric: Metric):
        self.metric, self.name = metric, metric.name

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        n = len(candidates)
        rows, cols = _ordered_pairs(n)
        values = self.metric.per_sample([candidates[i] for i in rows], [[candidates[j]] for j in cols])
        return np.asarray(values, dtype=np.float64).reshape(n, n)


class RewardUtility:
    """A reward with references (``reward.terms``): one ``score`` call over the N² ordered pairs, each candidate
    scored with the other as its reference and the pool's source as its source."""

    name = "reward"

    def __init__(self, reward: Reward):
        if not reward.needs_references:
            raise ValueError("an MBR utility compares two candidates, and these reward.terms read no references: "
                             "they would give every candidate the same expected utility as its own score "
                             "(use --rerank reward for a reference-free reward)")
        self.reward = reward

    def matrix(self, candidates: Sequence[str], source: str = "") -> np.ndarray:
        n = len(candidates)
        rows, cols = _ordered_pairs(n)
        values = self.reward.score([source] * (n * n), [candidates[i] for i in rows], [[candidates[j]] for j in cols])
        return np.asarray(values, dtype=np.float64).reshape(n, n)


def pair_utility(metric: Metric | Reward) -> PairUtility:
    """The utility of a metric (vectorised for BLEU-4, SacreBLEU, CIDEr-D and the task score) or of a reward with
    references."""
    if isinstance(metric, TaskScore):
        return TaskScoreUtility(metric)
    if isinstance(metric, CiderD):
        return CiderDUtility.of(metric)
    if isinstance(metric, Bleu4 | SacreBleu):
        return BleuUtility.of(metric)
    if isinstance(metric, Metric):
        return MetricUtility(metric)
    return RewardUtility(metric)


VECTORISED_METRICS = ("bleu4", "cider_d", "sacrebleu", "task_score")
"""The registered metrics whose pair utility is computed from n-gram count matrices (:func:`pair_utility`)."""

_PROBE_HYPS = ["a b c d", "a b c d"]
_PROBE_REFS = [["a b c d"], ["w x y z"]]


def reads_references(metric: Metric) -> bool:
    """Whether ``metric`` reads its references: one hypothesis scored against itself and against a disjoint text.
    A metric that gives both the same (a length, distinct-n) would give every candidate the same expected utility
    as its own score."""
    values = np.asarray(metric.per_sample(list(_PROBE_HYPS), [list(r) for r in _PROBE_REFS]), dtype=np.float64)
    if values.shape != (2,):
        raise ValueError(f"per_sample returned shape {values.shape} for 2 samples")
    return bool(values[0] != values[1])


def metric_utility(name: str, key: str, **params) -> PairUtility:
    """The registered metric ``name``, built with ``params``, as a pair utility. ValueError naming the config key
    or field ``key`` when it cannot be built (a metric needing a model path, METEOR without WordNet), fails on a
    probe pair, or reads no references."""
    try:
        metric = get_metric(name, **params)
    except Exception as e:  # any construction failure is a bad setting, not a crash later
        raise ValueError(f"{key}={name!r}: the metric cannot be built as an MBR utility ({type(e).__name__}: {e})"
                         ) from e
    try:
        reads = reads_references(metric)
    except Exception as e:
        raise ValueError(f"{key}={name!r}: the metric fails on a probe pair ({type(e).__name__}: {e})") from e
    if not reads:
        raise ValueError(f"{key}={name!r}: this metric reads no references, so an MBR utility built on it would give "
                         "every candidate its own score as expected utility; choose a metric that compares the "
                         "candidate with a reference (task_score, bleu4, cider_d, rouge_l, chrf, ...)")
    return pair_utility(metric)
