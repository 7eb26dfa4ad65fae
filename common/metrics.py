"""Sequence-level text metrics: the eval tables and the RL rewards both score text with these.

Texts are strings whose tokens are separated by whitespace (the competition texts are integer ids,
"12 7 401"); every hypothesis comes with one or more references. Each metric gives a float64 score
per sample (what a reward needs) and a corpus value (what an eval table shows). BLEU and chrF are
reported in [0, 1] (sacrebleu's value / 100) so they mix with CIDEr-D without rescaling.

Metrics are looked up by name (``get_metric("cider_d", sigma=15.0)``); ``register_metric`` adds new
ones. CIDEr-D reproduces the coco-caption evaluator (pycocoevalcap ``cider_scorer.py``) to the last
bit of its conventions, so numbers compare with published ones; see :class:`CiderD`.

The rest come from the libraries everybody's published numbers come from: ROUGE-1/2/L/Lsum from
``rouge-score`` (Google's reimplementation of ROUGE-1.5.5), METEOR from nltk (WordNet read from the local
``wordnet-base`` data), SacreBLEU and chrF from sacrebleu; distinct-n, lengths and a classifier's accuracy
over the outputs are counted here. Each class's docstring states its tokenisation, casing and whether the
corpus value is a mean of sentence scores or a statistic over the whole corpus. Perplexity of the
references needs the model, so it is not a text metric: see ``rlt2t.learner.evaluate``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
from nltk.stem.porter import PorterStemmer
from nltk.translate.meteor_score import meteor_score
from rouge_score import rouge_scorer, tokenizers
from sacrebleu.metrics import BLEU, CHRF

from rlt2t.common.io import atomic_write_text
from rlt2t.common.wordnet import find_wordnet, nltk_wordnet

if TYPE_CHECKING:
    from rlt2t.common.config import MetricConfig

CIDER_MAX_ORDER = 4
"""CIDEr-D uses n-grams of 1..4 tokens."""

_DF_FORMAT = "rlt2t.cider_document_frequency"
_DF_VERSION = 1

Ngram = tuple[str, ...]


# --------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------


def _validate_refs(refs: Sequence[Sequence[str]]) -> None:
    if isinstance(refs, str):
        raise TypeError("refs must be a sequence of sequences of strings, got one str")
    for i, item_refs in enumerate(refs):
        if isinstance(item_refs, str):
            raise TypeError(f"refs[{i}] must be a sequence of reference strings, got one str")
        if len(item_refs) == 0:
            raise ValueError(f"refs[{i}] has no references; every item needs at least one")
        for j, ref in enumerate(item_refs):
            if not isinstance(ref, str):
                raise TypeError(f"refs[{i}][{j}] must be a str, got {type(ref).__name__}")


def validate_inputs(hyps: Sequence[str], refs: Sequence[Sequence[str]], *, allow_empty: bool = True) -> None:
    """Check that ``hyps[i]`` is a string and ``refs[i]`` a non-empty sequence of strings for every i.

    Raises ValueError for mismatched lengths, an item without references, or (``allow_empty=False``)
    no samples at all; TypeError for wrong types (the classic mistake being ``refs=["a b", ...]``
    instead of ``refs=[["a b"], ...]``). Empty strings are legal texts.
    """
    if isinstance(hyps, str):
        raise TypeError("hyps must be a sequence of strings, got one str")
    if isinstance(refs, str):
        raise TypeError("refs must be a sequence of sequences of strings, got one str")
    if len(hyps) != len(refs):
        raise ValueError(f"hyps and refs differ in length: len(hyps)={len(hyps)}, len(refs)={len(refs)}")
    if not allow_empty and len(hyps) == 0:
        raise ValueError("a corpus score needs at least one sample; hyps and refs are empty")
    for i, hyp in enumerate(hyps):
        if not isinstance(hyp, str):
            raise TypeError(f"hyps[{i}] must be a str, got {type(hyp).__name__}")
    _validate_refs(refs)


def _ngram_counts(text: str) -> list[Counter[Ngram]]:
    """N-gram counts of ``text`` split on whitespace, one Counter per order 1..4 (index 0 = unigrams)."""
    words = text.split()
    # zip over shifted views builds the n-gram tuples in C, in left-to-right order like the reference.
    return [
        Counter(zip(*(words[k:] for k in range(order)), strict=False))
        for order in range(1, CIDER_MAX_ORDER + 1)
    ]


# --------------------------------------------------------------------------------------------------
# CIDEr-D
# --------------------------------------------------------------------------------------------------


class DocumentFrequency:
    """CIDEr-D document frequencies: in how many reference sets (items) each n-gram occurs.

    An n-gram counts once per item however many of the item's references contain it. ``num_ref_sets``
    is N in the idf term ``log N - log max(1, df)``. Build it once from the training references
    (``from_references``) and ship it to reward workers: it pickles compactly and round-trips through
    JSON (``to_json``/``from_json``, ``save``/``load``).
    """

    def __init__(self, num_ref_sets: int, counts: Mapping[Ngram, int]):
        if not isinstance(num_ref_sets, int) or isinstance(num_ref_sets, bool) or num_ref_sets < 1:
            raise ValueError(f"num_ref_sets must be a positive int, got {num_ref_sets!r}")
        for ngram, df in counts.items():
            if not (isinstance(ngram, tuple) and 1 <= len(ngram) <= CIDER_MAX_ORDER):
                raise ValueError(f"counts key {ngram!r} must be a tuple of 1..{CIDER_MAX_ORDER} tokens")
            if not isinstance(df, int) or not 1 <= df <= num_ref_sets:
                raise ValueError(
                    f"counts[{ngram!r}]={df!r} must be an int in [1, num_ref_sets={num_ref_sets}]"
                )
        self.num_ref_sets = num_ref_sets
        self.counts: dict[Ngram, int] = dict(counts)
        # log N, and the idf of every known n-gram precomputed once: scoring then costs one dict lookup
        # per n-gram. An unseen n-gram has df 0 -> log max(1, 0) = 0 -> idf = log N.
        self.log_num_ref_sets = math.log(float(num_ref_sets))
        self.idf: dict[Ngram, float] = {
            g: self.log_num_ref_sets - math.log(max(1.0, float(df))) for g, df in self.counts.items()
        }

    @classmethod
    def from_references(cls, refs: Sequence[Sequence[str]]) -> DocumentFrequency:
        """Count document frequencies over ``refs`` (one sequence of reference strings per item)."""
        _validate_refs(refs)
        if len(refs) == 0:
            raise ValueError("refs is empty; document frequencies need at least one reference set")
        return cls._from_ref_counts([[_ngram_counts(r) for r in item] for item in refs])

    @classmethod
    def _from_ref_counts(cls, ref_counts: Iterable[list[list[Counter[Ngram]]]]) -> DocumentFrequency:
        df: Counter[Ngram] = Counter()
        num_sets = 0
        for item in ref_counts:
            num_sets += 1
            seen: set[Ngram] = set()
            for per_order in item:
                for counts in per_order:
                    seen.update(counts)
            df.update(seen)
        return cls(num_sets, df)

    def to_json(self) -> str:
        """Serialize to a JSON string (n-grams as space-joined tokens; tokens never contain whitespace)."""
        payload = {
            "format": _DF_FORMAT,
            "version": _DF_VERSION,
            "num_ref_sets": self.num_ref_sets,
            "df": {" ".join(g): df for g, df in self.counts.items()},
        }
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> DocumentFrequency:
        """Inverse of ``to_json``."""
        payload = json.loads(text)
        if not isinstance(payload, dict) or payload.get("format") != _DF_FORMAT:
            raise ValueError(f"not a document-frequency file: 'format' must be {_DF_FORMAT!r}")
        if payload.get("version") != _DF_VERSION:
            raise ValueError(f"unsupported document-frequency 'version' {payload.get('version')!r}")
        raw = payload.get("df")
        if not isinstance(raw, dict):
            raise ValueError("document-frequency field 'df' must be an object of n-gram -> count")
        num_ref_sets: Any = payload.get("num_ref_sets")  # checked, with the counts, by __post_init__
        return cls(num_ref_sets, {tuple(k.split()): v for k, v in raw.items()})

    def save(self, path: str | os.PathLike) -> None:
        """Write ``to_json()`` to ``path`` atomically."""
        atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> DocumentFrequency:
        """Read a file written by ``save``."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DocumentFrequency):
            return NotImplemented
        return self.num_ref_sets == other.num_ref_sets and self.counts == other.counts

    __hash__ = None  # type: ignore[assignment]  # mutable dicts inside

    def __reduce__(self):
        # Pickle only the counts; the idf table is rebuilt on arrival, which keeps what Ray ships small.
        return (DocumentFrequency, (self.num_ref_sets, self.counts))

    def __repr__(self) -> str:
        return f"DocumentFrequency(num_ref_sets={self.num_ref_sets}, ngrams={len(self.counts)})"


def _cached_counts(text: str, cache: dict[str, list[Counter[Ngram]]]) -> list[Counter[Ngram]]:
    counts = cache.get(text)
    if counts is None:
        counts = cache[text] = _ngram_counts(text)
    return counts


class _TfIdf:
    """One sentence as CIDEr-D sees it: tf-idf weights and their norm per order, and its 'length'."""

    __slots__ = ("vecs", "norms", "length")

    def __init__(self, counts: list[Counter[Ngram]], df: DocumentFrequency):
        idf, default = df.idf, df.log_num_ref_sets
        # The reference code uses the raw count as term frequency: weight = count * idf.
        self.vecs = [{g: float(tf) * idf.get(g, default) for g, tf in c.items()} for c in counts]
        self.norms = [math.sqrt(sum(w * w for w in vec.values())) for vec in self.vecs]
        # Reference quirk kept for comparability: the "length" in the length penalty is the number of
        # bigrams, max(len - 1, 0), not the number of tokens. The two differ only for an empty text,
        # whose similarity is 0 anyway, so the penalty equals a token-length penalty where it matters.
        self.length = sum(counts[1].values())


def _cider_pair(hyp: _TfIdf, ref: _TfIdf, sigma: float) -> list[float]:
    """Per-order clipped cosine similarity of hyp and one ref, times the Gaussian length penalty."""
    delta = float(hyp.length - ref.length)
    penalty = math.exp(-(delta * delta) / (2.0 * sigma * sigma))
    out = []
    for vec_h, vec_r, norm_h, norm_r in zip(hyp.vecs, ref.vecs, hyp.norms, ref.norms, strict=True):
        val = 0.0
        for g, w_h in vec_h.items():
            w_r = vec_r.get(g)
            if w_r is not None:
                val += min(w_h, w_r) * w_r  # clipping: a repeated n-gram earns no more than the ref has
        if norm_h != 0.0 and norm_r != 0.0:
            val /= norm_h * norm_r
        out.append(val * penalty)
    return out


class CiderD:
    """CIDEr-D exactly as the coco-caption evaluator computes it (pycocoevalcap 1.2 ``CiderScorer``).

    For an item with hypothesis h and references r_1..r_m:
    ``10 * mean_n( sum_j sim_n(h, r_j) ) / m`` with, per n-gram order n in 1..4,
    ``sim_n = sum_g min(w_h[g], w_r[g]) * w_r[g] / (|w_h| |w_r|) * exp(-delta^2 / (2 sigma^2))``,
    weights ``w[g] = count(g) * (log N - log max(1, df(g)))`` and delta the difference in bigram counts.

    ``df=None`` is the coco default: N and df come from the references being scored, so a sample's
    score depends on the rest of the batch (and is 0 for a batch of one item, where log N = 0). RL
    rewards should pass a ``DocumentFrequency`` built from the training references (or a path to one
    saved with ``DocumentFrequency.save``); then a sample's score depends on that sample only.
    The corpus value is the mean of the per-sample scores, as in coco-caption.
    """

    name = "cider_d"

    def __init__(self, sigma: float = 6.0, df: DocumentFrequency | str | os.PathLike | None = None):
        if not (isinstance(sigma, int | float) and sigma > 0):
            raise ValueError(f"sigma must be a positive number, got {sigma!r}")
        if isinstance(df, str | os.PathLike):
            df = DocumentFrequency.load(df)
        if df is not None and not isinstance(df, DocumentFrequency):
            raise TypeError(f"df must be a DocumentFrequency, a path or None, got {type(df).__name__}")
        self.sigma = float(sigma)
        self.df = df

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D per sample; float64 [N], values in [0, 10]."""
        validate_inputs(hyps, refs)
        if len(hyps) == 0:
            return np.zeros(0, dtype=np.float64)
        # The same reference string recurs across samples (several candidates per source in RL),
        # so count and weight each distinct one once per call.
        counts_by_text: dict[str, list[Counter[Ngram]]] = {}
        ref_counts = [[_cached_counts(r, counts_by_text) for r in item] for item in refs]
        df = self.df if self.df is not None else DocumentFrequency._from_ref_counts(ref_counts)
        ref_vec_cache: dict[str, _TfIdf] = {}
        scores = np.empty(len(hyps), dtype=np.float64)
        for i, (hyp, item_refs, item_counts) in enumerate(zip(hyps, refs, ref_counts, strict=True)):
            vec_h = _TfIdf(_ngram_counts(hyp), df)
            total = [0.0] * CIDER_MAX_ORDER
            for ref, counts in zip(item_refs, item_counts, strict=True):
                vec_r = ref_vec_cache.get(ref)
                if vec_r is None:
                    vec_r = ref_vec_cache[ref] = _TfIdf(counts, df)
                for n, v in enumerate(_cider_pair(vec_h, vec_r, self.sigma)):
                    total[n] += v
            scores[i] = sum(total) / CIDER_MAX_ORDER / len(item_refs) * 10.0
        return scores

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Mean of ``per_sample`` (the coco-caption corpus CIDEr-D)."""
        validate_inputs(hyps, refs, allow_empty=False)
        return float(np.mean(self.per_sample(hyps, refs)))


# --------------------------------------------------------------------------------------------------
# sacrebleu-backed metrics
# --------------------------------------------------------------------------------------------------


def _reference_streams(refs: Sequence[Sequence[str]]) -> Sequence[Sequence[str]]:
    """Transpose per-item reference lists into sacrebleu's reference streams; None pads items with fewer."""
    width = max(len(item) for item in refs)
    streams = [[item[k] if k < len(item) else None for item in refs] for k in range(width)]
    # sacrebleu documents None as the padding of a missing reference; its annotation says str only.
    return cast(Sequence[Sequence[str]], streams)


def _sacrebleu_bleu(tokenize: str, smooth_method: str, **options: Any) -> BLEU:
    """sacrebleu's BLEU, with errors that name the argument (sacrebleu raises a bare one for a bad tokenizer)."""
    if smooth_method not in BLEU.SMOOTH_DEFAULTS:
        raise ValueError(f"smooth_method must be one of {sorted(BLEU.SMOOTH_DEFAULTS)}, got {smooth_method!r}")
    try:
        return BLEU(tokenize=tokenize, smooth_method=smooth_method, **options)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"tokenize={tokenize!r} is not a sacrebleu tokenizer: {e}") from e


class Bleu4:
    """BLEU-4 from sacrebleu, in [0, 1].

    Defaults are plain BLEU-4: no smoothing and no effective order, so a sample without any matching
    4-gram (including any hypothesis shorter than 4 tokens) scores 0. ``tokenize`` is sacrebleu's
    tokenizer ("13a" leaves integer-id texts unchanged). The corpus value is sacrebleu's corpus BLEU
    (statistics summed over samples), not the mean of sentence scores.
    """

    name = "bleu4"

    def __init__(
        self,
        smooth_method: str = "none",
        smooth_value: float | None = None,
        tokenize: str = "13a",
        effective_order: bool = False,
    ):
        if smooth_value is not None and (isinstance(smooth_value, bool) or not isinstance(smooth_value, int | float)):
            raise ValueError(f"smooth_value must be a number or null, got {smooth_value!r}")
        self.smooth_method = smooth_method
        self.smooth_value = smooth_value
        self.tokenize = tokenize
        self.effective_order = effective_order
        self._bleu = _sacrebleu_bleu(tokenize, smooth_method, smooth_value=smooth_value,
                                     effective_order=effective_order,
                                     force=True)  # never warn about "tokenized" input: id texts are by nature

    def _sentence(self, hyp: str, item_refs: Sequence[str]) -> float:
        # A one-sentence corpus is exactly sacrebleu's sentence_score (same statistics, same formula)
        # minus the warning sentence_score logs on every call when effective_order is off.
        return self._bleu.corpus_score([hyp], [[r] for r in item_refs]).score / 100.0

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Sentence BLEU-4 per sample; float64 [N] in [0, 1]."""
        validate_inputs(hyps, refs)
        return np.array(
            [self._sentence(h, r) for h, r in zip(hyps, refs, strict=True)],
            dtype=np.float64,
        )

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Corpus BLEU-4 in [0, 1]."""
        validate_inputs(hyps, refs, allow_empty=False)
        return self._bleu.corpus_score(list(hyps), _reference_streams(refs)).score / 100.0


class Chrf:
    """chrF from sacrebleu (character n-grams, best reference per sample), in [0, 1].

    sacrebleu's conventions: case-sensitive; whitespace is removed before character n-grams are counted,
    so on integer-id texts ("12 7 401") the characters are digits of adjacent ids run together, and chrF
    measures digit overlap rather than token overlap: use it on natural-language text. ``word_order=2``
    gives chrF++. Per sample: sacrebleu's sentence chrF against the best-scoring reference. The corpus value
    is sacrebleu's corpus chrF (character and word n-gram statistics summed over the samples, each with
    its best reference, then one F-score), not the mean of the sentence scores.
    """

    name = "chrf"

    def __init__(self, char_order: int = 6, word_order: int = 0, beta: int = 2):
        for arg, value, low in (
            ("char_order", char_order, 1),
            ("word_order", word_order, 0),
            ("beta", beta, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
        self.char_order, self.word_order, self.beta = char_order, word_order, beta
        self._chrf = CHRF(char_order=char_order, word_order=word_order, beta=beta)

    def _sentence(self, hyp: str, item_refs: Sequence[str]) -> float:
        return self._chrf.sentence_score(hyp, list(item_refs)).score / 100.0

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Sentence chrF per sample; float64 [N] in [0, 1]."""
        validate_inputs(hyps, refs)
        return np.array(
            [self._sentence(h, r) for h, r in zip(hyps, refs, strict=True)],
            dtype=np.float64,
        )

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Corpus chrF in [0, 1]."""
        validate_inputs(hyps, refs, allow_empty=False)
        return self._chrf.corpus_score(list(hyps), _reference_streams(refs)).score / 100.0


# --------------------------------------------------------------------------------------------------
# ROUGE-L, task score, length
# --------------------------------------------------------------------------------------------------


def _lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token lists (O(len(a)·len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


class _SentenceMetric:
    """A metric scored one sample at a time (``_score``) whose corpus value is the mean of the samples'."""

    def _score(self, hyp: str, item_refs: Sequence[str]) -> float:
        raise NotImplementedError

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """The score of each sample against its references; float64 [N] in [0, 1]."""
        validate_inputs(hyps, refs)
        return np.array([self._score(h, r) for h, r in zip(hyps, refs, strict=True)], dtype=np.float64)

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Mean of ``per_sample``."""
        validate_inputs(hyps, refs, allow_empty=False)
        return float(np.mean(self.per_sample(hyps, refs)))


class RougeL(_SentenceMetric):
    """ROUGE-L F-measure as coco-caption computes it (pycocoevalcap 1.2 ``Rouge``), in [0, 1].

    With several references, precision and recall are each maximised over the references (possibly
    from different ones), then combined: ``(1 + beta^2) P R / (R + beta^2 P)``; 0 when P or R is 0.
    Tokens are whitespace-separated (coco splits on single spaces, which differs only for texts with
    repeated or non-space whitespace). The corpus value is the mean of the per-sample scores.
    """

    name = "rouge_l"

    def __init__(self, beta: float = 1.2):
        if not (isinstance(beta, int | float) and beta > 0):
            raise ValueError(f"beta must be a positive number, got {beta!r}")
        self.beta = float(beta)

    def _score(self, hyp: str, item_refs: Sequence[str]) -> float:
        hyp_tokens = hyp.split()
        if not hyp_tokens:
            return 0.0
        prec = rec = 0.0
        for ref in item_refs:
            ref_tokens = ref.split()
            if not ref_tokens:
                continue
            lcs = _lcs_length(ref_tokens, hyp_tokens)
            prec = max(prec, lcs / len(hyp_tokens))
            rec = max(rec, lcs / len(ref_tokens))
        if prec == 0.0 or rec == 0.0:
            return 0.0
        b2 = self.beta * self.beta
        return (1.0 + b2) * prec * rec / (rec + b2 * prec)


class TaskScore:
    """The competition score: ``(1 - w) * CIDEr-D + w * BLEU-4`` with ``w = bleu_weight``.

    w = 1/3 ranks RL pairs; the validation monitor uses the same class with w from its config (0 in
    the original). ``per_sample`` combines sentence BLEU-4; ``corpus`` combines the corpus CIDEr-D
    (mean over samples) with corpus BLEU-4, as the competition did, so it is generally *not* the
    mean of ``per_sample``. ``sigma`` and ``df`` go to CIDEr-D, ``smooth_method`` and ``tokenize``
    to BLEU-4.
    """

    name = "task_score"

    def __init__(
        self,
        bleu_weight: float = 1.0 / 3.0,
        sigma: float = 6.0,
        df: DocumentFrequency | str | os.PathLike | None = None,
        smooth_method: str = "none",
        tokenize: str = "13a",
    ):
        if not (isinstance(bleu_weight, int | float) and 0.0 <= bleu_weight <= 1.0):
            raise ValueError(f"bleu_weight must be a number in [0, 1], got {bleu_weight!r}")
        self.bleu_weight = float(bleu_weight)
        self.cider = CiderD(sigma=sigma, df=df)
        self.bleu = Bleu4(smooth_method=smooth_method, tokenize=tokenize)

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Per-sample task score; float64 [N]."""
        validate_inputs(hyps, refs)
        w = self.bleu_weight
        out = np.zeros(len(hyps), dtype=np.float64)
        # Skip a component whose weight is 0 (the validation monitor runs with w = 0).
        if w < 1.0:
            out += (1.0 - w) * self.cider.per_sample(hyps, refs)
        if w > 0.0:
            out += w * self.bleu.per_sample(hyps, refs)
        return out

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """``(1 - w) * corpus CIDEr-D + w * corpus BLEU-4``."""
        validate_inputs(hyps, refs, allow_empty=False)
        w = self.bleu_weight
        cider = self.cider.corpus(hyps, refs) if w < 1.0 else 0.0
        bleu = self.bleu.corpus(hyps, refs) if w > 0.0 else 0.0
        return (1.0 - w) * cider + w * bleu


class MeanLength:
    """Hypothesis length in whitespace tokens (per sample) and its mean (corpus); ignores the references."""

    name = "mean_length"

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Token count per hypothesis; float64 [N]."""
        validate_inputs(hyps, refs)
        return np.array([len(h.split()) for h in hyps], dtype=np.float64)

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Mean token count."""
        validate_inputs(hyps, refs, allow_empty=False)
        return float(np.mean(self.per_sample(hyps, refs)))


class MaxLength(MeanLength):
    """Hypothesis length in whitespace tokens (per sample) and its maximum (corpus); ignores the references."""

    name = "max_length"

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Longest hypothesis, in tokens."""
        validate_inputs(hyps, refs, allow_empty=False)
        return float(np.max(self.per_sample(hyps, refs)))


# --------------------------------------------------------------------------------------------------
# Library-backed: ROUGE (rouge-score), METEOR (nltk), SacreBLEU (sacrebleu)
# --------------------------------------------------------------------------------------------------


class _WhitespaceTokenizer:
    """rouge-score tokenizer interface: the text's whitespace-separated tokens, unchanged."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


class Rouge(_SentenceMetric):
    """ROUGE-N / ROUGE-L / ROUGE-Lsum F-measure from Google's ``rouge-score``, in [0, 1].

    ``rouge_type`` is rouge-score's name: ``rouge1``, ``rouge2`` (n-gram overlap), ``rougeL`` (longest common
    subsequence over the whole text) or ``rougeLsum`` (union LCS over sentences, which rouge-score takes to be
    separated by newlines: on one-line texts it equals ``rougeL``, as in the seeds' DailyDialog table).
    F-measure is the plain F1 (beta = 1). Note ``rouge_l`` is a different metric: coco-caption's ROUGE-L
    with beta 1.2 (:class:`RougeL`).

    Tokenisation: ``tokenize="default"`` is rouge-score's own (lower-cased, every run of characters other
    than a-z and 0-9 is a separator; Porter stemming with ``use_stemmer=True``), which is what HF
    ``evaluate``'s rouge and so RL4LMs and OpenRL report: integer ids and English words come through, but
    text in other scripts is dropped entirely. ``tokenize="whitespace"`` keeps every whitespace token as it
    is (case-sensitive; ``use_stemmer`` applies to the default tokenizer only), for such text. Several
    references: the best F-measure among them (rouge-score's ``score_multi``). The corpus value is the mean of
    the per-sample F-measures (HF ``evaluate`` reports a bootstrap estimate of the same mean).
    """

    def __init__(self, rouge_type: str = "rougeL", use_stemmer: bool = False, tokenize: str = "default"):
        if rouge_type not in ROUGE_TYPES:
            raise ValueError(f"rouge_type must be one of {ROUGE_TYPES}, got {rouge_type!r}")
        if tokenize not in ("default", "whitespace"):
            raise ValueError(f"tokenize must be 'default' (rouge-score's) or 'whitespace', got {tokenize!r}")
        self.name, self.rouge_type, self.use_stemmer, self.tokenize = rouge_type, rouge_type, use_stemmer, tokenize
        # rouge-score's default tokenizer passed explicitly: the same tokenizer, without its log line per scorer.
        tokenizer = _WhitespaceTokenizer() if tokenize == "whitespace" else tokenizers.DefaultTokenizer(use_stemmer)
        self._scorer = rouge_scorer.RougeScorer([rouge_type], use_stemmer=use_stemmer, tokenizer=tokenizer)

    def _score(self, hyp: str, item_refs: Sequence[str]) -> float:
        """F-measure against the best reference."""
        return float(self._scorer.score_multi(list(item_refs), hyp)[self.rouge_type].fmeasure)


class Meteor(_SentenceMetric):
    """METEOR from nltk (``nltk.translate.meteor_score``), with WordNet synonyms read from local files.

    Conventions: texts are split on whitespace (our texts are already tokenised; HF ``evaluate`` runs nltk's
    ``word_tokenize`` first, which differs only where punctuation is glued to a word), tokens lower-cased
    (nltk's default ``preprocess``), then aligned in nltk's order: exact match, Porter-stem match, WordNet
    synonym match (of the stems). ``alpha``, ``beta``, ``gamma`` are nltk's defaults (0.9, 3, 0.5): score
    = (1 - gamma * (chunks / matches) ^ beta) * P R / (alpha P + (1 - alpha) R). Several references: the
    best score among them. The corpus value is the mean of the sentence scores (what HF ``evaluate``, RL4LMs
    and OpenRL's DailyDialog table report), not METEOR's original corpus-level statistic.

    WordNet: ``wordnet_dir``, else ``$WNSEARCHDIR`` / ``$WNHOME``, else Debian's ``wordnet-base``
    (``/usr/share/wordnet``, installed by ``make system-deps``); never downloaded. A missing directory
    fails at construction with a FileNotFoundError saying what to install; :meth:`missing_dependency` says so
    without building anything (how the reward server, eval and the RL job check it before they start).
    """

    name = "meteor"

    def __init__(self, alpha: float = 0.9, beta: float = 3.0, gamma: float = 0.5,
                 wordnet_dir: str | os.PathLike | None = None):
        for arg, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{arg} must be a number >= 0, got {value!r}")
        if not alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        self.alpha, self.beta, self.gamma = float(alpha), float(beta), float(gamma)
        self.wordnet = nltk_wordnet(str(wordnet_dir) if wordnet_dir is not None else None)
        self._stemmer = PorterStemmer()

    @staticmethod
    def missing_dependency(wordnet_dir: str | os.PathLike | None = None, **_params: Any) -> str | None:
        """What METEOR lacks here, its WordNet data, and how to install it; None when the data is found."""
        try:
            find_wordnet(wordnet_dir)
        except FileNotFoundError as e:
            return str(e)
        return None

    def _score(self, hyp: str, item_refs: Sequence[str]) -> float:
        return meteor_score([r.split() for r in item_refs], hyp.split(), stemmer=self._stemmer,
                            wordnet=self.wordnet, alpha=self.alpha, beta=self.beta, gamma=self.gamma)


class SacreBleu:
    """SacreBLEU as published: sacrebleu's own defaults on detokenised text, in [0, 1].

    Unlike :class:`Bleu4` (plain BLEU-4 on token-id texts, no smoothing), this is the standard signature:
    give it text as a reader sees it (what ``Policy.decode`` returns with a subword or pretrained tokenizer)
    and sacrebleu tokenises it itself (``tokenize="13a"``, case-sensitive unless ``lowercase``), with
    exponential smoothing (``smooth_method="exp"``). The corpus value is sacrebleu's corpus BLEU (n-gram
    statistics summed over the corpus). Per sample: sacrebleu's ``sentence_score`` (effective order on, as
    sacrebleu recommends for single sentences). The seeds' DailyDialog table reports this metric / 100.
    """

    name = "sacrebleu"

    def __init__(self, tokenize: str = "13a", smooth_method: str = "exp", lowercase: bool = False):
        self.tokenize, self.smooth_method, self.lowercase = tokenize, smooth_method, lowercase
        self._corpus_bleu = _sacrebleu_bleu(tokenize, smooth_method, lowercase=lowercase)
        self._sentence_bleu = _sacrebleu_bleu(tokenize, smooth_method, lowercase=lowercase, effective_order=True)

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Sentence SacreBLEU per sample; float64 [N] in [0, 1]."""
        validate_inputs(hyps, refs)
        return np.array([self._sentence_bleu.sentence_score(h, list(r)).score / 100.0
                         for h, r in zip(hyps, refs, strict=True)], dtype=np.float64)

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Corpus SacreBLEU in [0, 1]."""
        validate_inputs(hyps, refs, allow_empty=False)
        return self._corpus_bleu.corpus_score(list(hyps), _reference_streams(refs)).score / 100.0


# --------------------------------------------------------------------------------------------------
# Diversity, and a classifier's verdict on the outputs
# --------------------------------------------------------------------------------------------------


def _ngrams(tokens: Sequence[str], n: int) -> list[Ngram]:
    return list(zip(*(tokens[k:] for k in range(n)), strict=False))


class Distinct:
    """distinct-n (Li et al. 2016): distinct n-grams / all n-grams of the hypotheses; ignores the references.

    Tokens are whitespace-separated, case-sensitive. The corpus value pools every hypothesis: distinct
    n-grams over the whole output set / n-grams in it (RL4LMs' ``diversity`` convention), so repeating one
    answer for every source lowers it even if each answer is varied. Per sample: the same ratio within one
    hypothesis (a repetition penalty when used as a reward); 0 for a hypothesis with no n-gram.
    """

    def __init__(self, n: int = 1):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        self.n, self.name = n, f"distinct_{n}"

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Distinct-n within each hypothesis; float64 [N] in [0, 1]."""
        validate_inputs(hyps, refs)
        out = np.zeros(len(hyps), dtype=np.float64)
        for i, h in enumerate(hyps):
            grams = _ngrams(h.split(), self.n)
            if grams:
                out[i] = len(set(grams)) / len(grams)
        return out

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Distinct n-grams over all hypotheses / all their n-grams (0 when there is none)."""
        validate_inputs(hyps, refs, allow_empty=False)
        grams = [g for h in hyps for g in _ngrams(h.split(), self.n)]
        return len(set(grams)) / len(grams) if grams else 0.0


def saved_id2label(model_dir: str | os.PathLike) -> dict[int, str]:
    """The class names a saved classifier's ``config.json`` gives (``id2label``), by class id; read without
    loading the model."""
    raw = json.loads((Path(model_dir) / "config.json").read_text()).get("id2label") or {}
    return {int(k): str(v) for k, v in raw.items()}


def class_index(id2label: dict[int, str], label: str | int, what: str, where: str) -> int:
    """The output index of a classifier's class named by ``label``: one of its ``id2label`` names, else a class
    id (an int, or a string of digits that names no class). The one rule of the classifier metric and reward."""
    if isinstance(label, bool) or not isinstance(label, int | str):
        raise TypeError(f"{what} must be a label name or class id, got {type(label).__name__}")
    if isinstance(label, str):
        names = {name: index for index, name in id2label.items()}
        if label in names:
            return names[label]
        if not label.isdigit():
            raise ValueError(f"{what}={label!r} is not a label of {where} (labels: {', '.join(names)})")
        label = int(label)
    if label not in id2label:
        raise ValueError(f"{what}={label}: {where} has classes 0..{len(id2label) - 1}")
    return label


class ClassifierAccuracy:
    """Share of outputs a text classifier puts in the expected class (intent, sentiment), in [0, 1].

    ``path`` is a local Hugging Face sequence-classification directory (``from_pretrained``: model and
    tokenizer), or a checkpoint root of one (`rlt2t classifier train`'s ``checkpoints``). Each hypothesis is
    classified alone (truncated to ``max_length`` tokens); its label is the argmax class, named by the model's
    ``id2label``. The expected label of sample i is, in this order:
    ``labels[i]`` (from the data, e.g. DailyDialog's intent; names or class ids), else ``target_label``
    (one class for every output, e.g. "positive" for sentiment steering), else the classifier's label of the
    sample's first reference (agreement with the reference: needs no labels, so it also works as a reward).
    Per sample 1.0 / 0.0; the corpus value is their mean.
    """

    name = "classifier_accuracy"

    def __init__(self, path: str | os.PathLike, labels: Sequence[str | int] | None = None,
                 target_label: str | int | None = None, batch_size: int = 32, max_length: int = 512,
                 device: str = "cpu"):
        # transformers is heavy to import; only this metric needs it, and reward workers import this module.
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from rlt2t.common.checkpoint import resolve_model_dir

        try:  # a model directory, or a checkpoint root (its best, else newest, complete checkpoint), as a reward's
            path = resolve_model_dir(path)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"classifier path {e}") from None
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"classifier path {path}: not a model directory (no config.json)")
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batch_size and max_length must be >= 1, got {batch_size}, {max_length}")
        self.path, self.batch_size, self.max_length, self.device = path, batch_size, max_length, device
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(device).eval()
        self.id2label = {int(k): str(v) for k, v in self.model.config.id2label.items()}
        where = str(path)
        self.labels = None if labels is None else [
            self.id2label[class_index(self.id2label, x, f"labels[{i}]", where)] for i, x in enumerate(labels)]
        self.target_label = None if target_label is None else \
            self.id2label[class_index(self.id2label, target_label, "target_label", where)]

    def predict(self, texts: Sequence[str]) -> list[str]:
        """The classifier's label name for each text."""
        import torch  # as transformers above: only this metric needs it

        out: list[str] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                # One segment per text: token type ids are all 0, the default of models that use them at all.
                enc = self.tokenizer(list(texts[start : start + self.batch_size]), padding=True, truncation=True,
                                     max_length=self.max_length, return_token_type_ids=False,
                                     return_tensors="pt").to(self.device)
                ids = self.model(**enc).logits.argmax(-1).tolist()
                out += [self.id2label[i] for i in ids]
        return out

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """1.0 where the hypothesis gets its expected label, else 0.0; float64 [N]."""
        validate_inputs(hyps, refs)
        if self.labels is not None:
            if len(self.labels) != len(hyps):
                raise ValueError(f"{len(self.labels)} expected labels for {len(hyps)} hypotheses")
            expected = self.labels
        elif self.target_label is not None:
            expected = [self.target_label] * len(hyps)
        else:
            expected = self.predict([r[0] for r in refs])
        got = self.predict(hyps)
        return np.array([g == e for g, e in zip(got, expected, strict=True)], dtype=np.float64)

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """Accuracy: mean of ``per_sample``."""
        validate_inputs(hyps, refs, allow_empty=False)
        return float(np.mean(self.per_sample(hyps, refs)))


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Metric(Protocol):
    """What every registered metric provides."""

    name: str

    def per_sample(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> np.ndarray:
        """Score of each sample; float64 [N] for N = len(hyps) = len(refs)."""
        ...

    def corpus(self, hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
        """One score for the whole set."""
        ...


MetricFactory = Callable[..., Metric]
_F = TypeVar("_F", bound=Callable[..., Metric])

_REGISTRY: dict[str, MetricFactory] = {}


def register_metric(name: str, *, replace: bool = False) -> Callable[[_F], _F]:
    """Decorator registering a metric class or factory (called with keyword params) under ``name``: an eval
    column (``--metrics name``), a reward term (``{kind: metric, name: name}``) and a reward-server metric.

        @rlt2t.register_metric("exclamations")
        class Exclamations:
            name = "exclamations"
            def per_sample(self, hyps, refs): return np.array([h.count("!") for h in hyps], dtype=float)
            def corpus(self, hyps, refs): return float(self.per_sample(hyps, refs).mean())

    Registering a taken name raises ValueError unless ``replace=True``. Ray workers and servers know it when
    its module is in ``reward.plugins`` (or registered by the script that starts the job).

    A metric that needs data or a package beyond the project's Python dependencies gives the factory a static or
    class method ``missing_dependency(**params) -> str | None`` (:meth:`Meteor.missing_dependency`): what is
    missing and the command that installs it, checked without building the metric. Where it says something is
    missing the reward server does not offer the metric, and ``rlt2t eval`` and the RL job refuse it before they
    decode (:func:`missing_dependency`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric name must be a non-empty str, got {name!r}")

    def decorator(factory: _F) -> _F:
        if not callable(factory):
            raise TypeError(
                f"register_metric({name!r}) needs a class or callable, got {type(factory).__name__}"
            )
        if name in _REGISTRY and not replace:
            raise ValueError(f"metric {name!r} is already registered; pass replace=True to override it")
        _REGISTRY[name] = factory
        return factory

    return decorator


def available_metrics() -> list[str]:
    """Registered metric names, sorted."""
    return sorted(_REGISTRY)


def missing_dependency(name: str, **params) -> str | None:
    """What the registered metric ``name`` built with ``params`` needs and this machine lacks (data, a package),
    with the command that installs it; None when nothing is missing, or when ``name`` is not registered (that is
    :func:`get_metric`'s error). Asks the factory's ``missing_dependency`` (see :func:`register_metric`; params a
    check does not take are ignored); checks files, builds nothing, so it is cheap enough for a start-up check."""
    factory = _REGISTRY.get(name)
    while isinstance(factory, functools.partial):  # a registered partial: the class's check, with its keywords
        params = {**factory.keywords, **params}
        factory = factory.func
    check = getattr(factory, "missing_dependency", None)
    return check(**params) if check is not None else None


def check_dependencies(names: Iterable[str], what: str,
                       params_by_metric: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """ValueError naming ``what`` (e.g. ``--metrics``), each metric of ``names`` whose data or package is missing
    (:func:`missing_dependency`) and the fix: what a command checks before it decodes anything."""
    params_by_metric = params_by_metric or {}
    missing = [f"{name} cannot run here: {reason}" for name in names
               if (reason := missing_dependency(name, **params_by_metric.get(name, {}))) is not None]
    if missing:
        raise ValueError(f"{what}: " + "; ".join(missing))


def get_metric(name: str, **params) -> Metric:
    """Build the metric registered as ``name`` with keyword ``params``; unknown name -> ValueError."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown metric {name!r}; known metrics: {', '.join(available_metrics())}"
        ) from None
    try:
        return factory(**params)
    except TypeError as e:
        # Typically a misspelt parameter; name the metric so a config error is easy to place.
        raise TypeError(f"metric {name!r} rejected params {sorted(params)}: {e}") from e


def metric_params(name: str, metric: MetricConfig) -> dict[str, Any]:
    """The configured parameters of a registered metric (CIDEr-D's σ, the task score's weight): how the eval
    tables, predict's oracle and MBR utilities build it."""
    if name == "cider_d":
        return {"sigma": metric.cider_sigma}
    if name == "task_score":
        return {"bleu_weight": metric.bleu_weight, "sigma": metric.cider_sigma}
    return {}


def compute_metrics(
    names: Sequence[str],
    hyps: Sequence[str],
    refs: Sequence[Sequence[str]],
    **params_by_metric: Mapping[str, object],
) -> dict[str, float]:
    """Corpus value of each metric in ``names``, e.g. for an eval table.

    ``params_by_metric`` maps a metric name to its params:
    ``compute_metrics(["cider_d", "bleu4"], hyps, refs, cider_d={"sigma": 15.0})``.
    """
    if isinstance(names, str):
        raise TypeError("names must be a sequence of metric names, got one str")
    stray = sorted(set(params_by_metric) - set(names))
    if stray:
        raise ValueError(f"params given for metrics not in names: {stray}; names={list(names)}")
    validate_inputs(hyps, refs, allow_empty=False)
    return {
        name: get_metric(name, **dict(params_by_metric.get(name, {}))).corpus(hyps, refs) for name in names
    }


for _cls in (CiderD, Bleu4, RougeL, Chrf, TaskScore, MeanLength, MaxLength, Meteor, SacreBleu, ClassifierAccuracy):
    register_metric(_cls.name)(_cls)
del _cls
for _type in ROUGE_TYPES:
    register_metric(_type)(functools.partial(Rouge, _type))
for _n in (1, 2):
    register_metric(f"distinct_{_n}")(functools.partial(Distinct, _n))
del _type, _n

_BUILTIN: dict[str, MetricFactory] = dict(_REGISTRY)


def user_metrics() -> dict[str, MetricFactory]:
    """The metrics registered in this process beyond (or replacing) the built-in ones: what user code and plugins
    added, which a fresh interpreter (a Ray worker) does not have until they are registered there too."""
    return {name: f for name, f in _REGISTRY.items() if _BUILTIN.get(name) is not f}
