"""Ensemble prediction (docs/design.md, "The method", step 7): generators propose, scorers score, a reranker picks.

    rlt2t predict --generators G1,G2 --scorers S1,S2 --input test.jsonl --out pred.csv [--rerank idf]

Each generator (a CTranslate2 export) proposes ``predict.num_hypotheses`` beam-search hypotheses
(``predict.beam_size``) per input; the candidates of an input are pooled across generators and
deduplicated (whitespace-normalised text, first occurrence kept). Each scorer computes the per-token
log-probs of every candidate (teacher forcing) over the candidate's training labels, the tokenizer's full target
template (EOS included, and BART's leading ``<s>`` where its tokenizer puts one); the rerank mode
(``predict.rerank``, see :mod:`rlt2t.common.rerank`; ``reward`` scores the candidates with ``reward.terms``
without references, each input's extra fields as row fields) picks one. A plain Hugging Face model directory or
checkpoint root is accepted too (a LoRA adapter checkpoint merged into its base): it is exported on the fly
(``export.quantization``) into ``{export.out}/cache/`` and reused while its weights do not change.

Models CTranslate2 cannot convert (a warm-started EncoderDecoderModel) run on the torch backend instead
(``predict.backend``: ``auto`` picks per model, ``torch`` runs every model directory on Hugging Face): the same
beam search and teacher-forced scores as the policy server's torch backend.

Outputs: the submission CSV ``report_id,prediction`` (header-less) at ``out`` and
``<out stem>.candidates.jsonl`` beside it with each input's candidates, which generators proposed them,
per-scorer mean log-probs, rerank scores and the chosen one. When every input has a target, the result
also holds the metric table: each generator alone (its top hypothesis), the ensemble, and the oracle (the
best candidate by the task score).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from rlt2t.common.checkpoint import resolve_model_dir
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import Config, DataConfig
from rlt2t.common.ct2 import Ct2Policy, Hypothesis, export_ct2, is_export_dir, source_checksum, source_family
from rlt2t.common.data import Example, export_competition_csv, import_competition_csv, load_data, reference_sets
from rlt2t.common.io import atomic_write_jsonl
from rlt2t.common.metrics import CiderD, DocumentFrequency, get_metric
from rlt2t.common.rerank import (
    RERANK_MODES,
    IdfTable,
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
PREDICT_RERANK_MODES = (*RERANK_MODES, "reward")


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


def read_inputs(path: str | Path, data: DataConfig) -> list[Example]:
    """Inputs from the competition CSV (a ``.csv`` file, unless data.format=csv), else any data format as
    ``data`` reads it (JSONL, Parquet, datasets: ``id``, ``source``, optional ``target`` by the data.*_field
    mapping)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--input {path}: no such file")
    if path.suffix.lower() == ".csv" and data.format == "auto":
        return list(import_competition_csv(path, on_error=data.on_error))
    return list(load_data(path, data, require_target=False))


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
    """A model directory on the torch backend, with Ct2Policy's ``generate`` / ``score`` (what predict calls)."""

    def __init__(self, cfg: Config, model_dir: Path) -> None:
        self.backend = TorchBackend.from_checkpoint(cfg, model_dir)
        self.max_source_len = cfg.data.max_source_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.backend.tokenizer

    def generate(self, sources: Sequence[str], *, beam_size: int, num_hypotheses: int, max_new_tokens: int
                 ) -> list[list[Hypothesis]]:
        params = Sampling(mode="beam", beam_size=beam_size, num_candidates=num_hypotheses,
                          max_new_tokens=max_new_tokens)
        per_source = self.backend.candidates(sources, params, [])
        return [[Hypothesis(g.text, tuple(g.token_ids), float(sum(g.logprobs))) for g in gens] for gens in per_source]

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[list[float]]:
        """Per-token log-probs of each target given its source, teacher-forced in batches: one per id of the
        training labels of the target (the tokenizer's full target template, ``encode_texts(..., target=True)``),
        as :meth:`Ct2Policy.score` gives them."""
        tok = self.backend.tokenizer
        src, _ = encode_texts(tok, sources, self.max_source_len)
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
        return "ct2", path
    if backend == "torch" or (backend == "auto" and path.exists() and not _convertible(path)):
        if not path.exists():
            raise FileNotFoundError(f"--{role} {path}: no such directory")
        return "torch", resolve_model_dir(path)
    return "ct2", resolve_export(cfg, path, role)


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
    train = cfg.path(cfg.data.train)
    if train.exists():
        targets = reference_sets(load_data(train, cfg.data))
        if targets:
            return CiderD(sigma=cfg.metric.cider_sigma, df=DocumentFrequency.from_references(targets))
    log.info("rerank=consensus: data.train %s not found; CIDEr-D takes its df from the candidates", train)
    return CiderD(sigma=cfg.metric.cider_sigma)


def _unique_names(paths: Sequence[Path]) -> list[str]:
    names: list[str] = []
    for p in paths:
        name = p.name
        while name in names:
            name = f"{p.parent.name}/{name}"
        names.append(name)
    return names


def _batches(n: int, size: int, desc: str, progress: bool):
    return tqdm(range(0, n, size), desc=desc, disable=not progress, leave=False, total=(n + size - 1) // size)


def predict(
    cfg: Config,
    generators: Sequence[str | Path],
    scorers: Sequence[str | Path],
    input_path: str | Path,
    out_path: str | Path,
    *,
    rerank: str | None = None,
) -> PredictResult:
    """Generate, score and rerank; write the CSV and the candidates JSONL. See the module docstring."""
    mode = rerank or cfg.predict.rerank
    if mode not in PREDICT_RERANK_MODES:
        raise ValueError(f"--rerank: unknown mode {mode!r} (known: {', '.join(PREDICT_RERANK_MODES)})")
    if not generators:
        raise ValueError("--generators: give at least one export directory")
    if not scorers:
        raise ValueError("--scorers: give at least one export directory")
    check_out_path(out_path, input_path)  # before any decoding, not after it
    examples = read_inputs(input_path, cfg.data)
    if not examples:
        raise ValueError(f"--input {input_path}: no inputs")
    gen_models = [resolve_model(cfg, g, "generators") for g in generators]
    score_models = [resolve_model(cfg, s, "scorers") for s in scorers]
    gen_dirs, score_dirs = [d for _, d in gen_models], [d for _, d in score_models]
    kinds = {path: kind for kind, path in gen_models + score_models}
    p = cfg.predict
    progress = cfg.run.progress
    loaded: dict[Path, Ct2Policy | TorchRunner] = {}

    def policy(path: Path) -> Ct2Policy | TorchRunner:
        if path not in loaded:  # one model per directory, even when it both generates and scores
            loaded[path] = (TorchRunner(cfg, path) if kinds[path] == "torch" else
                            Ct2Policy(path, intra_threads=cfg.export.threads, max_source_len=cfg.data.max_source_len))
        return loaded[path]

    table = load_idf_table(cfg, [*score_dirs, *gen_dirs]) if mode == "idf" else None
    if mode == "idf":
        # Before any decoding: the IDF weights are per whitespace word, and every scorer's tokens must map to
        # the words (its tokenizer's offsets). Loading the scorers now costs nothing: they are loaded to score.
        for path in score_dirs:
            try:
                check_word_alignment(policy(path).tokenizer)
            except ValueError as e:
                raise ValueError(f"--rerank idf: the scorer {path}: {e}; use --rerank mean_logprob or "
                                 "--rerank consensus, or another scorer") from None
    cider = _consensus_cider(cfg) if mode == "consensus" else None
    reward = reference_free_reward(cfg) if mode == "reward" else None  # before decoding: a bad term fails now
    sources = [e.source for e in examples]
    gen_names, score_names = _unique_names(gen_dirs), _unique_names(score_dirs)

    # 1. Candidates: every generator's hypotheses, pooled and deduplicated per input.
    tops: dict[str, list[str]] = {}
    pools: list[dict[str, list[str]]] = [{} for _ in examples]  # text -> generators that proposed it
    for name, path in zip(gen_names, gen_dirs, strict=True):
        ct2 = policy(path)
        tops[name] = []
        for start in _batches(len(sources), p.batch_size, f"generate {name}", progress):
            chunk = ct2.generate(sources[start : start + p.batch_size], beam_size=p.beam_size,
                                 num_hypotheses=p.num_hypotheses, max_new_tokens=p.max_new_tokens)
            for i, hyps in enumerate(chunk, start):
                tops[name].append(hyps[0].text)
                for h in hyps:
                    pools[i].setdefault(h.text, [])
                    if name not in pools[i][h.text]:
                        pools[i][h.text].append(name)
    candidates = [list(pool) for pool in pools]

    # 2. Scores: every scorer, every candidate (flattened so batches are full).
    flat = [(i, c) for i, cands in enumerate(candidates) for c in cands]
    logprobs: list[list[list[list[float]]]] = [[[] for _ in score_names] for _ in examples]  # [input][scorer][cand]
    # idf: the whitespace word of each scored token, per input, scorer and candidate (rlt2t.common.rerank).
    words: list[list[list[list[int | None]]]] = [[[] for _ in score_names] for _ in examples]
    for s, (name, path) in enumerate(zip(score_names, score_dirs, strict=True)):
        ct2 = policy(path)
        for start in _batches(len(flat), p.batch_size, f"score {name}", progress):
            part = flat[start : start + p.batch_size]
            for (i, _), lp in zip(part, ct2.score([sources[i] for i, _ in part], [c for _, c in part]), strict=True):
                logprobs[i][s].append(lp)
            if mode == "idf":
                for (i, _), w in zip(part, token_words(ct2.tokenizer, [c for _, c in part]), strict=True):
                    words[i][s].append(w)

    # 3. Rerank.
    rewards: list[np.ndarray] = []
    if reward is not None:
        flat_scores = reward.score([sources[i] for i, _ in flat], [c for _, c in flat],
                                   fields=[examples[i].extra for i, _ in flat])
        for cands in candidates:
            rewards.append(flat_scores[: len(cands)])
            flat_scores = flat_scores[len(cands) :]
    chosen: list[int] = []
    rows = []
    for idx, (ex, cands, lps) in enumerate(zip(examples, candidates, logprobs, strict=True)):
        means = mean_logprobs(lps)
        if mode == "mean_logprob":
            scores = means
        elif mode == "idf":
            assert table is not None, "loaded above for this mode"
            scores = idf_scores(cands, lps, table, words[idx])
        elif mode == "reward":
            scores = rewards[idx]
        else:
            assert cider is not None, "built above for this mode"
            kept = sorted(range(len(cands)), key=lambda k: -means[k])[: p.consensus_top]
            agreement = consensus_scores(cands, kept, cider)
            # Candidates outside the top get -inf; ties on agreement go to the better mean log-prob.
            scores = np.full(len(cands), -np.inf)
            for k, a in zip(kept, agreement, strict=True):
                scores[k] = a
        best = max(range(len(cands)), key=lambda k: (scores[k], means[k]))
        chosen.append(best)
        rows.append({
            "id": ex.id, "source": ex.source, **({"target": ex.target} if ex.target is not None else {}),
            "prediction": cands[best], "chosen": best, "rerank": mode,
            "candidates": [
                {"text": c, "generators": pools_i, "rerank_score": _json_float(scores[k]),
                 "mean_logprob": {sn: float(np.mean(lps[s][k])) for s, sn in enumerate(score_names)}}
                for k, (c, pools_i) in enumerate(zip(cands, pools[idx].values(), strict=True))
            ],
        })
    predictions = [cands[k] for cands, k in zip(candidates, chosen, strict=True)]

    out_path = Path(out_path)
    jsonl_path = out_path.with_name(out_path.stem + ".candidates.jsonl")
    ids = [e.id for e in examples]
    export_competition_csv(out_path, ids, predictions)
    atomic_write_jsonl(jsonl_path, rows)
    metrics = None
    if all(e.target is not None for e in examples):
        metrics = _metric_rows(cfg, [list(e.refs) for e in examples], tops, predictions, candidates, mode)
    log.info("predict: %d inputs, %.1f candidates each, rerank=%s → %s", len(examples),
             np.mean([len(c) for c in candidates]), mode, out_path)
    return PredictResult(ids=ids, predictions=predictions, csv_path=out_path, jsonl_path=jsonl_path, rerank=mode,
                         mean_candidates=float(np.mean([len(c) for c in candidates])), metrics=metrics)


def reference_free_reward(cfg: Config) -> WeightedReward:
    """``reward.terms`` as a reranker: every term must score without references (a reranker has none at test
    time); ValueError naming the first that needs them."""
    check_reward(cfg.reward)
    reward = build_reward(cfg.reward, device=cfg.reward.device)
    for weight, name, term in reward.terms:
        if weight and term.needs_references:
            raise ValueError(f"--rerank reward: reward.terms term {name} needs references, which a reranker does not "
                             "have; rerank with reference-free terms (python, reward_model, classifier)")
    return reward


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


def _metric_rows(cfg: Config, refs: Sequence[Sequence[str]], tops: dict[str, list[str]], predictions: list[str],
                 candidates: list[list[str]], mode: str) -> dict[str, dict[str, float]]:
    from rlt2t.learner.evaluate import metric_table

    rows = {name: metric_table(hyps, refs, cfg.metric) for name, hyps in tops.items()}
    rows[f"ensemble ({mode})"] = metric_table(predictions, refs, cfg.metric)
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
    rows["oracle"] = metric_table(oracle, refs, cfg.metric)
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

