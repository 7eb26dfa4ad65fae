"""Reranking of ensemble candidates (docs/design.md, "The method", step 7): pure functions over texts and
per-token log-probs.

Inputs for one source: ``candidates`` (texts, whitespace-separated tokens) and ``logprobs[s][c]``, the
per-token log-probs that scorer ``s`` gives candidate ``c`` under teacher forcing, one per token plus the
EOS last (what :meth:`rlt2t.common.ct2.Ct2Policy.score` returns). Every function returns the index of the
chosen candidate, or raises ValueError for malformed input.

- :func:`mean_logprob`: length-normalised log-likelihood averaged over scorers.
- :func:`idf_score`: the same mean with tokens weighted by the IDF of the training-corpus n-grams that
  cover them (the original's reranker; the table is :class:`IdfTable`, built by our own code). The n-grams are
  of whitespace words, so the weights are per word; with a subword scorer every piece of a word carries the
  word's weight (:func:`token_words` maps a scorer's tokens to the words through a fast tokenizer's offsets,
  :func:`idf_token_weights` gives each token its weight).
- :func:`consensus`: among the best candidates by mean log-prob, the one the others agree with most
  (mean CIDEr-D against the rest).

Reranking by a reward (``rlt2t predict --rerank reward``, ``rerank: reward`` on the policy server) scores the
candidates without references: :func:`check_reference_free` refuses a reward with a term that reads them.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rlt2t.common.io import atomic_write_text

if TYPE_CHECKING:  # torch, transformers and the metrics load where they are used: the CLI reads the modes below
    from transformers import PreTrainedTokenizerBase

    from rlt2t.common.metrics import CiderD
    from rlt2t.common.rewards import WeightedReward

RERANK_MODES = ("mean_logprob", "idf", "consensus")
"""The modes of :func:`rerank`, pure functions of the candidates and their log-probs."""
PREDICT_RERANK_MODES = (*RERANK_MODES, "reward", "mbr")
"""Every rerank mode of `rlt2t predict --rerank` and `rlt2t eval --rerank` (reward and mbr: ``rlt2t.ensemble``). The
one list: the CLI's choices come from it, and predict.rerank / eval.rerank declare the same values (a test checks)."""
_IDF_FORMAT = "rlt2t-idf"


class IdfTable:
    """Document frequencies of the 1..max_n-grams of a corpus (whitespace tokens); idf = log(N / df).

    N is the number of texts; df(g) counts the texts that contain g at least once. An n-gram not in the
    table is *unknown* (never seen in training targets) and has no idf.
    """

    def __init__(self, num_docs: int, max_n: int, df: dict[tuple[str, ...], int]):
        if isinstance(num_docs, bool) or not isinstance(num_docs, int) or num_docs < 1:
            raise ValueError(f"num_docs must be an int >= 1, got {num_docs!r}")
        if isinstance(max_n, bool) or not isinstance(max_n, int) or not 1 <= max_n <= 8:
            raise ValueError(f"max_n must be an int in [1, 8], got {max_n!r}")
        for g, count in df.items():
            if not 1 <= len(g) <= max_n or not 1 <= count <= num_docs:
                raise ValueError(f"df[{' '.join(g)!r}]={count}: n-gram order must be 1..{max_n}, count 1..{num_docs}")
        self.num_docs = num_docs
        self.max_n = max_n
        self.df = df
        log_n = math.log(num_docs)
        self._idf = {g: log_n - math.log(c) for g, c in df.items()}

    @classmethod
    def from_texts(cls, texts: Iterable[str], max_n: int = 2) -> IdfTable:
        """Count document frequencies over ``texts`` (e.g. the training targets)."""
        df: Counter[tuple[str, ...]] = Counter()
        num_docs = 0
        for text in texts:
            num_docs += 1
            tokens = text.split()
            df.update({tuple(tokens[i : i + n]) for n in range(1, max_n + 1) for i in range(len(tokens) - n + 1)})
        if num_docs == 0:
            raise ValueError("texts is empty; an IDF table needs at least one text")
        return cls(num_docs, max_n, dict(df))

    def idf(self, ngram: Sequence[str]) -> float | None:
        """log(N / df) of a known n-gram, None for an unknown one."""
        return self._idf.get(tuple(ngram))

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON, atomically."""
        payload = {"format": _IDF_FORMAT, "num_docs": self.num_docs, "max_n": self.max_n,
                   "df": {" ".join(g): c for g, c in self.df.items()}}
        atomic_write_text(path, json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> IdfTable:
        """Read a table written by :meth:`save` (ValueError naming the file when it is not one)."""
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg})") from None
        if not isinstance(payload, dict) or payload.get("format") != _IDF_FORMAT:
            raise ValueError(f"{path}: not an IDF table (format must be {_IDF_FORMAT!r})")
        return cls(payload["num_docs"], payload["max_n"], {tuple(k.split()): v for k, v in payload["df"].items()})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IdfTable):
            return NotImplemented
        return (self.num_docs, self.max_n, self.df) == (other.num_docs, other.max_n, other.df)

    __hash__ = None  # type: ignore[assignment]


def _check(candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]]) -> None:
    if not candidates:
        raise ValueError("candidates is empty")
    if not logprobs:
        raise ValueError("logprobs: need at least one scorer")
    for s, per_scorer in enumerate(logprobs):
        if len(per_scorer) != len(candidates):
            raise ValueError(f"logprobs[{s}] has {len(per_scorer)} entries for {len(candidates)} candidates")
        for c, lp in enumerate(per_scorer):
            if len(lp) == 0:
                raise ValueError(f"logprobs[{s}][{c}] is empty (it holds at least the EOS log-prob)")


def mean_logprobs(logprobs: Sequence[Sequence[Sequence[float]]]) -> np.ndarray:
    """Per candidate: the mean over scorers of the mean token log-prob (EOS included). [C] float64."""
    return np.mean([[float(np.mean(lp)) for lp in per_scorer] for per_scorer in logprobs], axis=0)


def mean_logprob(candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]]) -> int:
    """Index of the candidate with the highest length-normalised log-likelihood, averaged over scorers.

    score(c) = (1/S) Σ_s (1/|lp_s(c)|) Σ_t lp_s(c)_t. Ties go to the earlier candidate.
    """
    _check(candidates, logprobs)
    return int(np.argmax(mean_logprobs(logprobs)))


def idf_token_weights(text: str, table: IdfTable, words: Sequence[int | None]) -> np.ndarray | None:
    """The IDF weight w_t of each scored token of ``text`` (see :func:`idf_weighted_mean`), float64 [len(words)]:
    ``words[t]`` is the whitespace word of ``text`` the t-th token belongs to (None: a special token). Every token
    of one word gets the word's weight. None when no word of ``text`` is known to ``table`` (the weights carry no
    information: the plain mean applies)."""
    tokens = text.split()
    if any(w is not None and not 0 <= w < len(tokens) for w in words):
        raise ValueError(f"words: word indices must be in [0, {len(tokens)}) for {text!r}, got {list(words)}")
    sums = np.zeros(len(tokens))
    counts = np.zeros(len(tokens))
    for n in range(1, table.max_n + 1):
        for i in range(len(tokens) - n + 1):
            value = table.idf(tokens[i : i + n])
            if value is not None:
                sums[i : i + n] += value
                counts[i : i + n] += 1
    known = counts > 0
    if not known.any():
        return None
    per_word = np.divide(sums, counts, out=np.zeros_like(sums), where=known)
    mean_known = float(per_word[known].mean())
    per_word[~known] = mean_known
    return np.array([mean_known if w is None else per_word[w] for w in words], dtype=np.float64)


def idf_weighted_mean(text: str, logprobs: Sequence[float], table: IdfTable,
                      words: Sequence[int | None] | None = None) -> float:
    """IDF-weighted mean token log-prob of one candidate under one scorer.

    With whitespace words x_1..x_W of ``text`` and the scorer's log-probs lp_1..lp_T, where ``words[t]`` is the
    word the t-th scored token belongs to (None for a special token of the scorer's target template: the EOS,
    a leading ``<s>``, mBART's language code):

    - K(i) = the known n-grams (1 <= n <= table.max_n, df > 0) of the candidate's words that cover word i;
    - v_i = mean_{g in K(i)} idf(g) for words with K(i) non-empty ("known" words); v̄ = the mean of v over the
      known words, which every other word (unknown tokens) gets too;
    - w_t = v_{words[t]} for a token of a word (every piece of a word carries the word's weight, so uniform
      weights give back the plain mean of :func:`mean_logprobs`), w_t = v̄ for a special token;
    - score = Σ_t w_t·lp_t / Σ_t w_t.

    ``words`` defaults to one log-prob per word and then the EOS (a word-level tokenizer, like the `ids` one):
    ``[0, 1, ..., W - 1, None]``; for a subword scorer pass :func:`token_words` of its tokenizer.
    When no word is known, or Σ w_t = 0 (every known n-gram occurs in every training text), the weights
    carry no information and the score is the plain mean of lp: never a division by zero.
    """
    tokens = text.split()
    if words is None:
        if len(logprobs) != len(tokens) + 1:
            raise ValueError(
                f"idf rerank needs one log-prob per whitespace token plus the EOS: {len(tokens)} tokens, "
                f"{len(logprobs)} log-probs (for a subword scorer pass words=token_words(tokenizer, texts))"
            )
        words = [*range(len(tokens)), None]
    elif len(words) != len(logprobs):
        raise ValueError(f"words has {len(words)} entries for {len(logprobs)} log-probs")
    lp = np.asarray(logprobs, dtype=np.float64)
    weights = idf_token_weights(text, table, words)
    if weights is None:
        return float(lp.mean())
    total = weights.sum()
    if total <= 0.0:
        return float(lp.mean())
    return float((weights * lp).sum() / total)


def idf_scores(candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]], table: IdfTable,
               words: Sequence[Sequence[Sequence[int | None]]] | None = None) -> np.ndarray:
    """Per candidate: the mean over scorers of :func:`idf_weighted_mean`; ``words[s][c]``: the word of each
    log-prob of ``logprobs[s][c]`` (None: one per word then the EOS). [C] float64."""
    _check(candidates, logprobs)
    if words is not None and [len(w) for w in words] != [len(lp) for lp in logprobs]:
        raise ValueError("words must have one entry per scorer and candidate, like logprobs")
    per = words if words is not None else [[None] * len(candidates) for _ in logprobs]
    return np.mean([[idf_weighted_mean(text, lp, table, w)
                     for text, lp, w in zip(candidates, per_scorer, ws, strict=True)]
                    for per_scorer, ws in zip(logprobs, per, strict=True)], axis=0)


def idf_score(candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]], table: IdfTable,
              words: Sequence[Sequence[Sequence[int | None]]] | None = None) -> int:
    """Index of the candidate with the highest IDF-weighted mean log-prob (see :func:`idf_weighted_mean`)."""
    return int(np.argmax(idf_scores(candidates, logprobs, table, words)))


def check_word_alignment(tokenizer: PreTrainedTokenizerBase) -> None:
    """ValueError unless :func:`token_words` can tell which word each of ``tokenizer``'s tokens belongs to: it
    reads a fast (Rust) tokenizer's offset mapping, which a slow one (Marian's) does not have. The message names
    the tokenizer and what to do."""
    if not getattr(tokenizer, "is_fast", False):
        where = getattr(tokenizer, "name_or_path", "") or ""
        raise ValueError(f"its tokenizer ({type(tokenizer).__name__}{f' from {where}' if where else ''}) is not a "
                         "fast tokenizer: it has no offset mapping to tell which whitespace word each of its tokens "
                         "belongs to, and the IDF weights are per word. Give a scorer whose tokenizer loads as a "
                         "fast one (a tokenizer.json beside it: transformers' AutoTokenizer.from_pretrained(dir)"
                         ".save_pretrained(dir) writes one where transformers has a fast version of it, which "
                         "Marian has not), or rerank without it (mean_logprob, consensus, mbr, reward)")


def token_words(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int | None]]:
    """For each text: the whitespace word of the text each id of its training labels belongs to, None for the
    target template's special tokens (what a scorer scores, see ``Ct2Policy.target_ids``; ``words`` of
    :func:`idf_weighted_mean`). From the offset mapping: a piece belongs to the word of the first non-space
    character it covers; a piece of spaces alone, to the word after it. A word-level tokenizer with the
    ``text </s>`` template gives ``[0, ..., W - 1, None]``."""
    from rlt2t.common.collate import uses_target_template  # imports torch

    check_word_alignment(tokenizer)
    texts = list(texts)
    if not texts:
        return []
    kwargs = dict(add_special_tokens=True, truncation=False, return_offsets_mapping=True,
                  return_special_tokens_mask=True)
    enc = (tokenizer(text_target=texts, **kwargs) if uses_target_template(tokenizer)
           else tokenizer(texts, **kwargs))
    out: list[list[int | None]] = []
    for text, offsets, special in zip(texts, enc["offset_mapping"], enc["special_tokens_mask"], strict=True):
        starts = [i for i, c in enumerate(text) if not c.isspace() and (i == 0 or text[i - 1].isspace())]
        row: list[int | None] = []
        for (begin, _end), is_special in zip(offsets, special, strict=True):
            if is_special or not starts:
                row.append(None)
                continue
            at = begin
            while at < len(text) and text[at].isspace():
                at += 1
            row.append(max(bisect_right(starts, at) - 1, 0))
        out.append(row)
    return out


def check_reference_free(reward: WeightedReward, key: str) -> WeightedReward:
    """``reward`` itself when every weighted term scores without references; else ValueError naming ``key`` and the
    first term that reads them (a reranker picks at test time, with no reference to give it)."""
    for weight, name, term in reward.terms:
        if weight and term.needs_references:
            raise ValueError(f"{key} term {name} needs references, which a reranker does not have; rerank with "
                             "reference-free terms (python, reward_model, classifier, or an http term naming one "
                             "of the reward server's named rewards)")
    return reward


def consensus_scores(candidates: Sequence[str], top: Sequence[int], cider: CiderD) -> np.ndarray:
    """Mean CIDEr-D of each candidate in ``top`` against the other candidates of ``top``. [len(top)]."""
    if len(top) < 2:
        return np.zeros(len(top))
    hyps = [candidates[i] for i in top]
    refs = [[candidates[j] for j in top if j != i] for i in top]
    return cider.per_sample(hyps, refs)


def consensus(candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]], *, top: int = 8,
              cider: CiderD | None = None) -> int:
    """Index of the candidate the others agree with most.

    The ``top`` candidates by :func:`mean_logprobs` are kept; each is scored by its mean CIDEr-D against
    the other kept ones (its references); the highest wins, ties broken by mean log-prob. ``cider``
    should carry document frequencies of the training targets (``CiderD(df=...)``); without them CIDEr-D
    takes them from the kept candidates. One candidate (or ``top`` 1) falls back to :func:`mean_logprob`.
    """
    _check(candidates, logprobs)
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    means = mean_logprobs(logprobs)
    # Stable sort by descending mean: equal means keep candidate order, so the result is deterministic.
    kept = sorted(range(len(candidates)), key=lambda i: -means[i])[:top]
    if len(kept) < 2:
        return kept[0]
    if cider is None:
        from rlt2t.common.metrics import CiderD

        cider = CiderD()
    agreement = consensus_scores(candidates, kept, cider)
    best = max(range(len(kept)), key=lambda k: (agreement[k], means[kept[k]]))
    return kept[best]


def rerank(mode: str, candidates: Sequence[str], logprobs: Sequence[Sequence[Sequence[float]]], *,
           table: IdfTable | None = None, top: int = 8, cider: CiderD | None = None,
           words: Sequence[Sequence[Sequence[int | None]]] | None = None) -> int:
    """Dispatch on ``mode`` (one of :data:`RERANK_MODES`); ``words`` as in :func:`idf_scores` (mode idf)."""
    if mode == "mean_logprob":
        return mean_logprob(candidates, logprobs)
    if mode == "idf":
        if table is None:
            raise ValueError("rerank mode 'idf' needs an IdfTable (table=...)")
        return idf_score(candidates, logprobs, table, words)
    if mode == "consensus":
        return consensus(candidates, logprobs, top=top, cider=cider)
    raise ValueError(f"rerank: unknown mode {mode!r} (known: {', '.join(RERANK_MODES)})")
