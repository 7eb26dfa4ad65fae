"""Ensemble prediction (docs/design.md, "The method", step 7): generators propose, scorers score, a reranker picks.

    rlt2t predict --generators G1,G2 --scorers S1,S2 --input test.jsonl --out pred.csv [--rerank idf]

Each generator (a CTranslate2 export) proposes ``predict.num_hypotheses`` beam-search hypotheses
(``predict.beam_size``), ``predict.num_samples`` seeded samples, or both (``predict.pool``) per input; the
candidates of an input are pooled across generators and deduplicated (whitespace-normalised text, first
occurrence kept), each counting the entries it stands for. Each scorer computes the per-token
log-probs of every candidate (teacher forcing) over the candidate's training labels, the tokenizer's full target
template (EOS included, and BART's leading ``<s>`` where its tokenizer puts one); the rerank mode
(``predict.rerank``, see :mod:`rlt2t.common.rerank`; ``reward`` scores the candidates with ``reward.terms``
without references, each input's extra fields as row fields; ``mbr`` the highest expected
``predict.mbr_utility`` over the pool, :mod:`rlt2t.common.mbr`) picks one. A plain Hugging Face model directory or
checkpoint root is accepted too (a LoRA adapter checkpoint merged into its base): it is exported on the fly
(``export.quantization``) into ``{export.out}/cache/`` and reused while its weights do not change.

Models CTranslate2 cannot convert (a warm-started EncoderDecoderModel) run on the torch backend instead
(``predict.backend``: ``auto`` picks per model, ``torch`` runs every model directory on Hugging Face): the same
beam search and teacher-forced scores as the policy server's torch backend.

Outputs: the submission CSV ``report_id,prediction`` (header-less) at ``out`` and
``<out stem>.candidates.jsonl`` beside it with each input's candidates, which generators proposed them and how
many times (``entries``), per-scorer mean log-probs, rerank scores, the chosen one and the rerank's wall time
(``rerank_seconds``). When every input has a target, the result
also holds the metric table: each generator alone (its top hypothesis), the ensemble, and the oracle (the
best candidate by the task score).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from rlt2t.common.candidates import stable_seed
from rlt2t.common.checkpoint import resolve_model_dir
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import Config, DataConfig, PredictConfig, did_you_mean
from rlt2t.common.ct2 import Ct2Policy, Hypothesis, export_ct2, is_export_dir, source_checksum, source_family
from rlt2t.common.data import (
    DataError,
    Example,
    export_competition_csv,
    import_competition_csv,
    load_data,
    reference_sets,
)
from rlt2t.common.io import atomic_write_jsonl
from rlt2t.common.mbr import (
    PairUtility,
    RewardUtility,
    check_pool_size,
    mbr_choice,
    metric_utility,
    probability_weights,
)
from rlt2t.common.metrics import (
    CiderD,
    DocumentFrequency,
    available_metrics,
    check_dependencies,
    get_metric,
    metric_params,
)
from rlt2t.common.policy import Policy
from rlt2t.common.rerank import (
    PREDICT_RERANK_MODES,
    IdfTable,
    check_reference_free,
    check_word_alignment,
    consensus_scores,
    idf_scores,
    mean_logprobs,
    token_words,
)
from rlt2t.common.rewards import WeightedReward, build_reward, check_reward
from rlt2t.services.backends import Sampling, TorchBackend

log = logging.getLogger("rlt2t.predict")

IDF_FILE = "idf.json"


@dataclass
class PredictResult:
    ids: list[str]
    predictions: list[str]
    csv_path: Path
    jsonl_path: Path
    rerank: str
    mean_candidates: float
    """Mean number of distinct candidates per input."""
    metrics: dict[str, dict[str, float]] | None
    """Rows `<generator>`, `ensemble (<mode>)`, `oracle` when every input has a target, else None."""
    seconds_per_source: dict[str, float] = field(default_factory=dict)
    """Wall time per input of each stage: generate, score, rerank, and the total."""


def read_inputs(path: str | Path, data: DataConfig) -> list[Example]:
    """Inputs from the competition CSV (a ``.csv`` file without a header naming ``data.source_field``, unless
    data.format=csv), else any data format as ``data`` reads it (JSONL, a CSV with a header, Parquet, datasets:
    ``id``, ``source``, optional ``target`` by the data.*_field mapping)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--input {path}: no such file")
    if path.suffix.lower() == ".csv" and data.format == "auto" and not _names_column(path, data.source_field):
        try:
            return list(import_competition_csv(path, on_error=data.on_error))
        except DataError as e:
            if e.line != 1:
                raise
            raise DataError(e.path, e.line, e.field, f"{e.reason} (read as the competition's header-less CSV, as its "
                            f"first row names no {data.source_field!r} column: if that row is a header, name the "
                            "source column with data.source_field=…)") from None
    return list(load_data(path, data, require_target=False))


def _names_column(path: Path, name: str) -> bool:
    """Whether a CSV's first record is a header with the column ``name`` (the competition's file has none)."""
    from rlt2t.common.data_formats import csv_records

    first = next(csv_records(path), None)
    return first is not None and isinstance(first[1], list) and name in (cell.strip() for cell in first[1])


def resolve_export(cfg: Config, path: str | Path, role: str) -> Path:
    """An export directory for ``path``: itself, or an on-the-fly export of a model dir / checkpoint root."""
    path = Path(path)
    if is_export_dir(path):
        return path
    if not path.exists():
        raise FileNotFoundError(f"--{role} {path}: no such directory")
    try:
        model_dir = resolve_model_dir(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--{role} {path}: neither a CTranslate2 export (`rlt2t export`) nor a model directory / checkpoint root"
        ) from None
    quant = cfg.export.quantization
    cache = cfg.path(cfg.export.out) / "cache" / f"{model_dir.name}-{source_checksum(model_dir)[:12]}-{quant}"
    if not is_export_dir(cache):
        log.info("--%s %s is a model directory: exporting it (%s) to %s", role, model_dir, quant, cache)
        export_ct2(model_dir, cache, quant, force=True, tokenizer_dir=cfg.tokenizer_dir)
    return cache


class TorchRunner:
    """A model directory on the torch backend, with Ct2Policy's ``generate`` / ``score`` (what predict calls);
    ``policy``: that directory already loaded. Sources are cut to data.max_source_len tokens, as training and the
    CTranslate2 runner cut them, for generating and for scoring."""

    def __init__(self, cfg: Config, model_dir: Path, *, policy: Policy | None = None) -> None:
        cut = cfg.data.max_source_len
        if policy is None:
            self.backend = TorchBackend.from_checkpoint(cfg, model_dir, max_source_len=cut)
        else:
            self.backend = TorchBackend(policy, checkpoint=str(model_dir), max_source_len=cut,
                                        device=str(next(policy.model.parameters()).device))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.backend.tokenizer

    def generate(self, sources: Sequence[str], *, beam_size: int, num_hypotheses: int, max_new_tokens: int,
                 sampling_topk: int = 1, sampling_topp: float = 1.0, sampling_temperature: float = 1.0,
                 seed: int | None = None, sampling_epsilon: float = 0.0, no_repeat_ngram_size: int = 0,
                 repetition_penalty: float = 1.0, length_penalty: float = 1.0,
                 min_new_tokens: int = 0) -> list[list[Hypothesis]]:
        """Beam search (``beam_size`` > 1, or greedy with ``sampling_topk`` 1), else ``num_hypotheses`` samples per
        source (top-k 0: no filter), each row seeded from ``seed`` and its position, as Ct2Policy.generate; and,
        unlike it, ``sampling_epsilon`` > 0 for epsilon sampling. The repetition and length controls are beam
        search's and greedy decoding's (refused with sampling)."""
        controls: dict[str, Any] = {"no_repeat_ngram_size": no_repeat_ngram_size,
                                    "repetition_penalty": repetition_penalty, "length_penalty": length_penalty,
                                    "min_new_tokens": min_new_tokens}
        rows: list[int] = []
        if beam_size > 1 or sampling_topk == 1:
            params = Sampling(mode="beam", beam_size=beam_size, num_candidates=num_hypotheses if beam_size > 1 else 1,
                              max_new_tokens=max_new_tokens, **controls)
        else:
            params = Sampling(mode="sample", num_candidates=num_hypotheses, top_k=sampling_topk, top_p=sampling_topp,
                              temperature=sampling_temperature, beam_size=1, max_new_tokens=max_new_tokens,
                              epsilon=sampling_epsilon, **controls)
            base = seed if seed is not None else int.from_bytes(os.urandom(7), "big")
            rows = [stable_seed(base, i, j) for i in range(len(sources)) for j in range(num_hypotheses)]
        per_source = self.backend.candidates(sources, params, rows)
        if params.mode == "beam" and params.num_candidates < num_hypotheses:  # greedy: copies, as Ct2Policy
            per_source = [gens * num_hypotheses for gens in per_source]
        return [[Hypothesis(g.text, tuple(g.token_ids), float(sum(g.logprobs))) for g in gens] for gens in per_source]

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[list[float]]:
        """Per-token log-probs of each target given its source, teacher-forced in batches: one per id of the
        training labels of the target (the tokenizer's full target template, ``encode_texts(..., target=True)``),
        as :meth:`Ct2Policy.score` gives them."""
        tok = self.backend.tokenizer
        src, _ = encode_texts(tok, sources, self.backend.source_len)  # where generation cuts them too
        labels, _ = encode_texts(tok, targets, self.backend.max_positions, target=True)
        return self.backend.teacher_forced(src, labels)


def resolve_model(cfg: Config, path: str | Path, role: str) -> tuple[str, Path]:
    """("ct2", export dir) or ("torch", model dir) for a ``--generators`` / ``--scorers`` entry, by predict.backend."""
    path = Path(path)
    backend = cfg.predict.backend
    if is_export_dir(path):
        if backend == "torch":
            raise ValueError(f"--{role} {path}: a CTranslate2 export cannot run with predict.backend=torch; "
                             "pass its model directory")
        _check_ct2_sampling(cfg, path, role)
        return "ct2", path
    if backend == "torch" or (backend == "auto" and path.exists() and not _convertible(path)):
        if not path.exists():
            raise FileNotFoundError(f"--{role} {path}: no such directory")
        return "torch", resolve_model_dir(path)
    _check_ct2_sampling(cfg, path, role)
    return "ct2", resolve_export(cfg, path, role)


def _check_ct2_sampling(cfg: Config, path: Path, role: str) -> None:
    """A generator on CTranslate2 cannot draw the pool's samples with epsilon sampling: refused before exporting."""
    p = cfg.predict
    if role == "generators" and p.pool != "beam" and p.epsilon > 0:
        raise ValueError(f"predict.epsilon={p.epsilon}: --generators {path} runs on CTranslate2, which has no "
                         "epsilon sampling; set predict.backend=torch (with a model directory) or predict.epsilon=0")


def _convertible(path: Path) -> bool:
    try:
        return source_family(resolve_model_dir(path)).ct2  # an adapter checkpoint: its base's family
    except (FileNotFoundError, ValueError):
        return True  # let resolve_export say what is wrong with it


def load_idf_table(cfg: Config, exports: Sequence[Path]) -> IdfTable:
    """The IDF table saved beside an export (by `rlt2t export`), else rebuilt from data.train."""
    for export in exports:
        path = export / IDF_FILE
        if path.is_file():
            table = IdfTable.load(path)
            if table.max_n == cfg.predict.idf_max_n:
                return table
            log.info("%s has max_n=%d, predict.idf_max_n=%d: not used", path, table.max_n, cfg.predict.idf_max_n)
    train = cfg.path(cfg.data.train)
    if not train.exists():
        raise FileNotFoundError(
            f"rerank=idf: no {IDF_FILE} beside the exports and data.train {train} does not exist to rebuild it"
        )
    log.info("rerank=idf: no %s beside the exports; building it from %s", IDF_FILE, train)
    return build_idf_table(cfg)


def build_idf_table(cfg: Config) -> IdfTable:
    """IDF table of the training references (``data.train``: the targets, or every reference of a row that has
    several; rows repeating a source's references count them once, as CIDEr-D's document frequencies do),
    n-grams up to ``predict.idf_max_n``."""
    train = load_data(cfg.path(cfg.data.train), cfg.data)
    return IdfTable.from_texts((r for refs in reference_sets(train) for r in refs), cfg.predict.idf_max_n)


def _consensus_cider(cfg: Config) -> CiderD:
    return CiderD(sigma=cfg.metric.cider_sigma, df=_training_df(cfg, "rerank=consensus"))


def _unique_names(paths: Sequence[Path]) -> list[str]:
    names: list[str] = []
    for p in paths:
        name = p.name
        while name in names:
            name = f"{p.parent.name}/{name}"
        names.append(name)
    return names


def _batches(n: int, size: int, desc: str, progress: bool):
    # on a terminal only (disable=None): a log file would get a carriage-return line per update
    return tqdm(range(0, n, size), desc=desc, disable=None if progress else True, leave=False,
                total=(n + size - 1) // size)


def pool_entries(p: PredictConfig) -> int:
    """Entries one generator adds to an input's pool (``predict.pool``: beam hypotheses, samples, or both)."""
    return (p.num_hypotheses if p.pool != "sample" else 0) + (p.num_samples if p.pool != "beam" else 0)


def check_mbr_pool(p: PredictConfig, generators: int) -> None:
    """ValueError naming predict.max_pool when ``generators`` generators would give an input an MBR pool over it:
    before any decoding."""
    parts = ", ".join(x for x in (f"num_hypotheses={p.num_hypotheses}" if p.pool != "sample" else "",
                                  f"num_samples={p.num_samples}" if p.pool != "beam" else "") if x)
    check_pool_size(generators * pool_entries(p), p.max_pool, "predict.max_pool",
                    f" ({generators} generator(s) x {pool_entries(p)} each: predict.pool={p.pool}, {parts})")


def mbr_utility(cfg: Config, *, df: bool = True) -> PairUtility:
    """``predict.mbr_utility`` as a pair utility: a registered metric that reads references (configured as the eval
    tables configure it; CIDEr-D's document frequencies from data.train's references when it exists, else from the
    pool), or ``reward``: reward.terms, which must read references. ValueError naming the key for an unknown name,
    a metric that cannot be built or reads no reference, or a reward without references. ``df`` False: leave the
    document frequencies to the pool (a check before decoding that need not read data.train)."""
    name = cfg.predict.mbr_utility
    if name == "reward":
        check_reward(cfg.reward)
        try:
            return RewardUtility(build_reward(cfg.reward, device=cfg.reward.device))
        except ValueError as e:
            raise ValueError(f"predict.mbr_utility=reward: {e}") from None
    if name not in available_metrics():
        raise ValueError(f"predict.mbr_utility={name!r}: not a registered metric nor 'reward'"
                         f"{did_you_mean(name, [*available_metrics(), 'reward'], cutoff=0.6)} (metrics: "
                         f"{', '.join(available_metrics())}; a utility must read references)")
    params = metric_params(name, cfg.metric)
    if df and name in ("task_score", "cider_d"):
        params["df"] = _training_df(cfg, "rerank=mbr")
    return metric_utility(name, "predict.mbr_utility", **params)


def check_mbr_setup(cfg: Config, generators: int) -> None:
    """The cheap MBR checks, before any model is loaded or exported: the pool cap, and ``predict.mbr_utility`` (a
    metric built without data.train's document frequencies and probed; ``reward``: reward.terms checked, the reward
    is built later). ValueError naming the key."""
    check_mbr_pool(cfg.predict, generators)
    if cfg.predict.mbr_utility == "reward":
        check_reward(cfg.reward)
    else:
        mbr_utility(cfg, df=False)


def _training_df(cfg: Config, what: str) -> DocumentFrequency | None:
    train = cfg.path(cfg.data.train)
    if train.exists():
        targets = reference_sets(load_data(train, cfg.data))
        if targets:
            return DocumentFrequency.from_references(targets)
    log.info("%s: data.train %s not found; CIDEr-D takes its df from the candidates", what, train)
    return None


class _Runner(Protocol):
    """What predict asks of a generator or scorer: Ct2Policy, or TorchRunner."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def generate(self, sources: Sequence[str], *, beam_size: int, num_hypotheses: int, max_new_tokens: int,
                 sampling_topk: int = 1, sampling_topp: float = 1.0, sampling_temperature: float = 1.0,
                 seed: int | None = None, sampling_epsilon: float = 0.0, no_repeat_ngram_size: int = 0,
                 repetition_penalty: float = 1.0, length_penalty: float = 1.0,
                 min_new_tokens: int = 0) -> list[list[Hypothesis]]: ...

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[list[float]]: ...


def _pool_of(runner: _Runner, sources: Sequence[str], p: PredictConfig, seed: int) -> list[list[str]]:
    """Per source: the texts of the pool one generator adds (beam hypotheses best first, then samples)."""
    out: list[list[str]] = [[] for _ in sources]
    if p.pool != "sample":
        beams = runner.generate(sources, beam_size=p.beam_size, num_hypotheses=p.num_hypotheses,
                                max_new_tokens=p.max_new_tokens, no_repeat_ngram_size=p.no_repeat_ngram_size,
                                repetition_penalty=p.repetition_penalty, length_penalty=p.length_penalty,
                                min_new_tokens=p.min_new_tokens)
        for row, hyps in zip(out, beams, strict=True):
            row += [h.text for h in hyps]
    if p.pool != "beam":
        samples = runner.generate(sources, beam_size=1, num_hypotheses=p.num_samples, max_new_tokens=p.max_new_tokens,
                                  sampling_topk=p.top_k, sampling_topp=p.top_p, sampling_temperature=p.temperature,
                                  seed=seed, sampling_epsilon=p.epsilon)
        for row, hyps in zip(out, samples, strict=True):
            row += [h.text for h in hyps]
    return out


@dataclass
class Reranked:
    """What :func:`rerank_examples` picked, per input."""

    candidates: list[list[str]]
    """Distinct candidate texts, in order of first appearance."""
    counts: list[list[int]]
    """Entries of each candidate in the pool (proposals over generators, beams and samples)."""
    proposers: list[list[list[str]]]
    """The generators that proposed each candidate."""
    tops: dict[str, list[str]]
    """Each generator's own pick per input: its best beam hypothesis (its first sample with predict.pool=sample)."""
    logprobs: list[list[list[list[float]]]]
    """[input][scorer][candidate] per-token log-probs."""
    scores: list[np.ndarray]
    """The rerank score of each candidate (MBR: its expected utility)."""
    chosen: list[int]
    rerank_seconds: list[float]
    """Wall time of each input's rerank step."""
    seconds: dict[str, float]
    """Wall time of the stages (generate, score, rerank, total) over all inputs."""

    @property
    def predictions(self) -> list[str]:
        return [c[k] for c, k in zip(self.candidates, self.chosen, strict=True)]


def rerank_examples(cfg: Config, examples: Sequence[Example], generators: Sequence[tuple[str, _Runner]],
                    scorers: Sequence[tuple[str, _Runner]], mode: str, *, table: IdfTable | None = None,
                    cider: CiderD | None = None, reward: WeightedReward | None = None,
                    utility: PairUtility | None = None) -> Reranked:
    """Generate each input's pool (``predict.pool`` from every generator), score it with every scorer and pick one
    by ``mode``; ``table``, ``cider``, ``reward``, ``utility``: what modes idf, consensus, reward and mbr need."""
    p = cfg.predict
    progress = cfg.run.progress
    sources = [e.source for e in examples]
    started = time.perf_counter()

    # 1. Candidates: every generator's pool, deduplicated per input with each text's entries counted.
    tops: dict[str, list[str]] = {}
    pools: list[dict[str, list[str]]] = [{} for _ in examples]  # text -> generators that proposed it
    counts: list[Counter[str]] = [Counter() for _ in examples]
    for name, runner in generators:
        tops[name] = []
        for start in _batches(len(sources), p.batch_size, f"generate {name}", progress):
            chunk = _pool_of(runner, sources[start : start + p.batch_size], p, stable_seed(p.seed, name, start))
            for i, texts in enumerate(chunk, start):
                tops[name].append(texts[0])
                for text in texts:
                    counts[i][text] += 1
                    proposers = pools[i].setdefault(text, [])
                    if name not in proposers:
                        proposers.append(name)
    candidates = [list(pool) for pool in pools]
    generated = time.perf_counter()

    # 2. Scores: every scorer, every candidate (flattened so batches are full).
    flat = [(i, c) for i, cands in enumerate(candidates) for c in cands]
    logprobs: list[list[list[list[float]]]] = [[[] for _ in scorers] for _ in examples]  # [input][scorer][cand]
    # idf: the whitespace word of each scored token, per input, scorer and candidate (rlt2t.common.rerank).
    words: list[list[list[list[int | None]]]] = [[[] for _ in scorers] for _ in examples]
    for s, (name, runner) in enumerate(scorers):
        for start in _batches(len(flat), p.batch_size, f"score {name}", progress):
            part = flat[start : start + p.batch_size]
            for (i, _), lp in zip(part, runner.score([sources[i] for i, _ in part], [c for _, c in part]), strict=True):
                logprobs[i][s].append(lp)
            if mode == "idf":
                for (i, _), w in zip(part, token_words(runner.tokenizer, [c for _, c in part]), strict=True):
                    words[i][s].append(w)
    scored = time.perf_counter()

    # 3. Rerank.
    rewards: list[np.ndarray] = []
    if mode == "reward":
        assert reward is not None, "built by the caller for this mode"
        flat_scores = reward.score([sources[i] for i, _ in flat], [c for _, c in flat],
                                   fields=[examples[i].extra for i, _ in flat])
        for cands in candidates:
            rewards.append(flat_scores[: len(cands)])
            flat_scores = flat_scores[len(cands) :]
    chosen: list[int] = []
    all_scores: list[np.ndarray] = []
    seconds: list[float] = []
    for idx, (ex, cands, lps) in enumerate(zip(examples, candidates, logprobs, strict=True)):
        at = time.perf_counter()
        means = mean_logprobs(lps)
        best: int | None = None
        if mode == "mean_logprob":
            scores = means
        elif mode == "idf":
            assert table is not None, "loaded by the caller for this mode"
            scores = idf_scores(cands, lps, table, words[idx])
        elif mode == "reward":
            scores = rewards[idx]
        elif mode == "mbr":
            assert utility is not None, "built by the caller for this mode"
            entries = np.array([counts[idx][c] for c in cands])
            check_pool_size(int(entries.sum()), p.max_pool, "predict.max_pool", f" for input {ex.id!r}")
            # uniform: leave-one-out over the entries, duplicates counted; probability: over the distinct texts at
            # their probabilities, each candidate included (rlt2t.common.mbr).
            if p.mbr_weights == "probability":
                weights = probability_weights(np.mean([[sum(lp) for lp in per] for per in lps], axis=0))
                best, scores = mbr_choice(utility.matrix(cands, ex.source), weights)  # ties: the lower index
            else:
                best, scores = mbr_choice(utility.matrix(cands, ex.source), counts=entries)
        else:
            assert cider is not None, "built by the caller for this mode"
            kept = sorted(range(len(cands)), key=lambda k: -means[k])[: p.consensus_top]
            agreement = consensus_scores(cands, kept, cider)
            # Candidates outside the top get -inf; ties on agreement go to the better mean log-prob.
            scores = np.full(len(cands), -np.inf)
            for k, a in zip(kept, agreement, strict=True):
                scores[k] = a
        if best is None:
            best = max(range(len(cands)), key=lambda k: (scores[k], means[k]))
        chosen.append(best)
        all_scores.append(np.asarray(scores, dtype=np.float64))
        seconds.append(time.perf_counter() - at)
    done = time.perf_counter()
    return Reranked(candidates=candidates, counts=[[counts[i][c] for c in cands] for i, cands in enumerate(candidates)],
                    proposers=[list(pool.values()) for pool in pools], tops=tops, logprobs=logprobs,
                    scores=all_scores, chosen=chosen, rerank_seconds=seconds,
                    seconds={"generate": generated - started, "score": scored - generated, "rerank": done - scored,
                             "total": done - started})


def rerank_setup(cfg: Config, mode: str, score_dirs: Sequence[Path], gen_dirs: Sequence[Path],
                 tokenizer_of: Callable[[Path], PreTrainedTokenizerBase],
                 utility: PairUtility | None = None, reward: WeightedReward | None = None) -> dict[str, Any]:
    """What ``mode`` needs, built before any decoding so that a bad setting fails at once: the IDF table (and every
    scorer's word alignment), the consensus CIDEr-D, the reference-free reward, or the MBR utility (and the pool
    cap; ``utility``, ``reward``: already built)."""
    if mode not in PREDICT_RERANK_MODES:
        raise ValueError(f"--rerank: unknown mode {mode!r} (known: {', '.join(PREDICT_RERANK_MODES)})")
    if mode == "idf":
        table = load_idf_table(cfg, [*score_dirs, *gen_dirs])
        # The IDF weights are per whitespace word, and every scorer's tokens must map to the words (its tokenizer's
        # offsets). Loading the scorers now costs nothing: they are loaded to score.
        for path in score_dirs:
            try:
                check_word_alignment(tokenizer_of(path))
            except ValueError as e:
                raise ValueError(f"--rerank idf: the scorer {path}: {e}") from None
        return {"table": table}
    if mode == "consensus":
        return {"cider": _consensus_cider(cfg)}
    if mode == "reward":
        return {"reward": reward if reward is not None else reference_free_reward(cfg)}
    if mode == "mbr":
        check_mbr_pool(cfg.predict, len(gen_dirs))
        return {"utility": utility if utility is not None else mbr_utility(cfg)}
    return {}


def rerank_with_policy(cfg: Config, policy: Policy, checkpoint: Path, examples: Sequence[Example],
                       mode: str) -> Reranked:
    """`rlt2t eval --rerank`: one loaded model, on the torch backend where it is, generates each source's pool
    (``predict.pool``) and scores it; ``mode`` picks as in :func:`predict`."""
    runner = TorchRunner(cfg, checkpoint, policy=policy)
    needs = rerank_setup(cfg, mode, [checkpoint], [checkpoint], lambda _: runner.tokenizer)
    return rerank_examples(cfg, examples, [(checkpoint.name, runner)], [(checkpoint.name, runner)], mode, **needs)


def predict(
    cfg: Config,
    generators: Sequence[str | Path],
    scorers: Sequence[str | Path],
    input_path: str | Path,
    out_path: str | Path,
    *,
    rerank: str | None = None,
    metrics: Sequence[str] | None = None,
) -> PredictResult:
    """Generate, score and rerank; write the CSV and the candidates JSONL. See the module docstring. On labelled
    inputs, the table's columns are ``metrics`` (default: ``eval.metrics``, :func:`table_columns`)."""
    mode = rerank or cfg.predict.rerank
    if mode not in PREDICT_RERANK_MODES:
        raise ValueError(f"--rerank: unknown mode {mode!r} (known: {', '.join(PREDICT_RERANK_MODES)})")
    if not generators:
        raise ValueError("--generators: give at least one export directory")
    if not scorers:
        raise ValueError("--scorers: give at least one export directory")
    utility, reward = None, None
    # Before any export or decoding: resolve_model may export models for minutes.
    if mode == "mbr":
        check_mbr_pool(cfg.predict, len(generators))
        utility = mbr_utility(cfg)
    elif mode == "reward":
        reward = reference_free_reward(cfg)
    check_out_path(out_path, input_path)  # before any decoding, not after it
    examples = read_inputs(input_path, cfg.data)
    if not examples:
        raise ValueError(f"--input {input_path}: no inputs")
    labelled = all(e.target is not None for e in examples)
    columns = table_columns(cfg, metrics) if labelled else []  # checked before anything is exported or decoded
    gen_models = [resolve_model(cfg, g, "generators") for g in generators]
    score_models = [resolve_model(cfg, s, "scorers") for s in scorers]
    gen_dirs, score_dirs = [d for _, d in gen_models], [d for _, d in score_models]
    kinds = {path: kind for kind, path in gen_models + score_models}
    loaded: dict[Path, Ct2Policy | TorchRunner] = {}

    def policy(path: Path) -> Ct2Policy | TorchRunner:
        if path not in loaded:  # one model per directory, even when it both generates and scores
            loaded[path] = (TorchRunner(cfg, path) if kinds[path] == "torch" else
                            Ct2Policy(path, intra_threads=cfg.export.threads, max_source_len=cfg.data.max_source_len))
        return loaded[path]

    needs = rerank_setup(cfg, mode, score_dirs, gen_dirs, lambda path: policy(path).tokenizer, utility, reward)
    gen_names, score_names = _unique_names(gen_dirs), _unique_names(score_dirs)
    result = rerank_examples(cfg, examples, [(n, policy(d)) for n, d in zip(gen_names, gen_dirs, strict=True)],
                             [(n, policy(d)) for n, d in zip(score_names, score_dirs, strict=True)], mode, **needs)
    candidates, predictions = result.candidates, result.predictions
    rows = []
    for idx, (ex, cands, lps) in enumerate(zip(examples, candidates, result.logprobs, strict=True)):
        scores = result.scores[idx]
        rows.append({
            "id": ex.id, "source": ex.source, **({"target": ex.target} if ex.target is not None else {}),
            "prediction": cands[result.chosen[idx]], "chosen": result.chosen[idx], "rerank": mode,
            "rerank_seconds": result.rerank_seconds[idx],
            "candidates": [
                {"text": c, "generators": proposers, "entries": n, "rerank_score": _json_float(scores[k]),
                 "mean_logprob": {sn: float(np.mean(lps[s][k])) for s, sn in enumerate(score_names)}}
                for k, (c, proposers, n) in enumerate(zip(cands, result.proposers[idx], result.counts[idx],
                                                          strict=True))
            ],
        })

    out_path = Path(out_path)
    jsonl_path = out_path.with_name(out_path.stem + ".candidates.jsonl")
    ids = [e.id for e in examples]
    export_competition_csv(out_path, ids, predictions)
    atomic_write_jsonl(jsonl_path, rows)
    table = None
    if labelled:
        table = _metric_rows(cfg, [list(e.refs) for e in examples], result.tops, predictions, candidates, mode, columns)
    per_source = {stage: t / len(examples) for stage, t in result.seconds.items()}
    log.info("predict: %d inputs, %.1f candidates each, rerank=%s, %.3f s per input (rerank %.4f s) → %s",
             len(examples), np.mean([len(c) for c in candidates]), mode, per_source["total"], per_source["rerank"],
             out_path)
    return PredictResult(ids=ids, predictions=predictions, csv_path=out_path, jsonl_path=jsonl_path, rerank=mode,
                         mean_candidates=float(np.mean([len(c) for c in candidates])), metrics=table,
                         seconds_per_source=per_source)


def reference_free_reward(cfg: Config) -> WeightedReward:
    """``reward.terms`` as a reranker: every term must score without references (a reranker has none at test
    time); ValueError naming the first that needs them (:func:`rlt2t.common.rerank.check_reference_free`)."""
    check_reward(cfg.reward)
    return check_reference_free(build_reward(cfg.reward, device=cfg.reward.device), "--rerank reward: reward.terms")


def check_out_path(out_path: str | Path, input_path: str | Path | None = None) -> None:
    """ValueError naming --out when the CSV or the candidates JSONL beside it cannot be written as a file there,
    or when either of them is the ``--input`` file (writing it would replace the inputs with the predictions)."""
    out = Path(out_path)
    if out.is_dir() or not out.name:
        raise ValueError(f"--out {out_path}: is a directory; give the CSV file to write "
                         f"(e.g. --out {out / 'predictions.csv'})")
    jsonl = out.with_name(out.stem + ".candidates.jsonl")
    if jsonl.is_dir():
        raise ValueError(f"--out {out_path}: the candidates file beside it, {jsonl}, is a directory")
    if input_path is not None:
        if _same_file(out, Path(input_path)):
            raise ValueError(f"--out {out_path}: is the --input file {input_path}; writing the predictions there "
                             "would replace the inputs: give another --out")
        if _same_file(jsonl, Path(input_path)):
            raise ValueError(f"--out {out_path}: the candidates file beside it, {jsonl}, is the --input file "
                             f"{input_path}; writing it would replace the inputs: give --out another name")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"--out {out_path}: {parent} is a file, not a directory to write into")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same inode when both exist (links included), else the same resolved
    path (symlinks followed as far as they exist)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # a symlink loop, an unreadable parent: not provably the same
        return False


def _json_float(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def table_columns(cfg: Config, metrics: Sequence[str] | None = None) -> list[str]:
    """The columns of predict's table on labelled inputs: ``metrics`` or ``eval.metrics``, less the columns that
    need a model (perplexity) or a classifier (classifier_accuracy); ValueError naming the key for an unknown name
    or a metric this machine cannot run."""
    from rlt2t.learner.evaluate import MODEL_COLUMNS, check_metric_names

    what = "eval.metrics" if metrics is None else "metrics"
    given = check_metric_names(list(cfg.eval.metrics if metrics is None else metrics), what)
    names = [n for n in given if n not in MODEL_COLUMNS]
    check_dependencies(names, what)
    return names or ["task_score"]


def _metric_rows(cfg: Config, refs: Sequence[Sequence[str]], tops: dict[str, list[str]], predictions: list[str],
                 candidates: list[list[str]], mode: str, columns: Sequence[str]) -> dict[str, dict[str, float]]:
    from rlt2t.learner.evaluate import metric_table

    rows = {name: metric_table(hyps, refs, cfg.metric, columns) for name, hyps in tops.items()}
    rows[f"ensemble ({mode})"] = metric_table(predictions, refs, cfg.metric, columns)
    # Oracle: per input, the candidate with the best task score. CIDEr-D's df comes from the inputs'
    # references (one set per input), as in the corpus score, not from the repeated per-candidate refs.
    df = DocumentFrequency.from_references(refs)
    task = get_metric("task_score", bleu_weight=cfg.metric.bleu_weight, sigma=cfg.metric.cider_sigma, df=df)
    flat_hyps = [c for cands in candidates for c in cands]
    flat_refs = [r for cands, r in zip(candidates, refs, strict=True) for _ in cands]
    per = task.per_sample(flat_hyps, flat_refs)
    oracle, at = [], 0
    for cands in candidates:
        oracle.append(cands[int(np.argmax(per[at : at + len(cands)]))])
        at += len(cands)
    rows["oracle"] = metric_table(oracle, refs, cfg.metric, columns)
    return rows


def save_idf_beside(cfg: Config, export_dir: Path) -> Path | None:
    """Build the IDF table from data.train and save it as ``{export_dir}/idf.json`` (None if no data.train)."""
    train = cfg.path(cfg.data.train)
    if not train.exists():
        log.warning("data.train %s not found: no %s saved beside %s (predict rebuilds it when needed)",
                    train, IDF_FILE, export_dir)
        return None
    path = export_dir / IDF_FILE
    build_idf_table(cfg).save(path)
    return path

