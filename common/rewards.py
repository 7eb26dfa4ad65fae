"""Sequence rewards: the one registry every reward goes through. The reward workers of RL, the policy
server's ``/v1/pairs`` and the reward server all score a candidate given its source (and, for reference
metrics, its references) with a :class:`Reward` that :func:`build_reward` makes from ``reward.terms``:

    reward = build_reward(cfg.reward, document_frequency=df, device="cuda")
    scores = reward.score(sources, candidates, references)      # float64 [N], one per candidate

Term kinds (``RewardConfig.terms``, a weighted sum Σ weight·term):

- ``metric``: a registered metric of ``rlt2t.common.metrics`` (needs references);
- ``reward_model``: a learned r(source, candidate) (``rlt2t.common.reward_model``);
- ``classifier``: a sequence classifier's probability, log-probability or logit of one label;
- ``http``: a metric or a named reward of a reward server (``rlt2t serve reward``);
- ``python``: a function of your own (``rlt2t.common.python_rewards``), given the data rows' extra fields.

``reward.plugins`` (and installed ``rlt2t.plugins`` entry points) are imported before a reward is built
(``rlt2t.common.plugins``); :class:`UserRegistrations` carries what a script registered itself to the Ray reward
workers, and :func:`check_reward` resolves every term before a job starts any of them (and refuses a metric term
whose data or package is missing here, naming what to install: :func:`missing_dependencies`).

The default is today's rank-RL reward, the task score ``(1 - w) · CIDEr-D + w · BLEU-4`` (docs/design.md,
"Task metric") with CIDEr-D document frequencies counted once from the training references: with
frequencies counted from the batch being scored (the coco default) a candidate's reward would depend on
which other candidates share its batch, and a batch of one would always score 0. Learned terms run in
batches on the given device.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx
import numpy as np

from rlt2t.common.config import (
    ClassifierTerm,
    ConfigError,
    HttpTerm,
    MetricTerm,
    PythonTerm,
    RewardConfig,
    RewardModelTerm,
    RewardTerm,
)
from rlt2t.common.metrics import (
    DocumentFrequency,
    Metric,
    MetricFactory,
    available_metrics,
    class_index,
    get_metric,
    missing_dependency,
    register_metric,
    saved_id2label,
    user_metrics,
)
from rlt2t.common.plugins import load_plugins
from rlt2t.common.python_rewards import (
    PythonReward,
    RewardFn,
    register_reward,
    registered_rewards,
    term_function,
)
from rlt2t.common.types import CandidateSet, SampledGroup, ScoredGroup, ScoredPair

if TYPE_CHECKING:
    from rlt2t.common.reward_model import RewardModel

# torch, transformers and the learned terms' modules are imported where a learned term is built (or a device
# other than the CPU is asked for): a reward of reference metrics only, the default, scores without them,
# and a reward worker or server that needs none starts in a second instead of several.

# Metrics whose params come from the reward section (bleu_weight, cider_sigma) and the shipped df table.
_CIDER_METRICS = ("task_score", "cider_d")


@runtime_checkable
class Reward(Protocol):
    """What every reward provides."""

    needs_references: bool
    """True when ``score`` needs ``references`` (a reference metric is among the terms)."""

    def score(self, sources: Sequence[str], candidates: Sequence[str],
              references: Sequence[Sequence[str]] | None = None,
              fields: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
        """One float64 score per candidate [N]; ``sources``, ``references`` (one list per candidate) and
        ``fields`` (each candidate's data row's extra fields, for Python terms) align with ``candidates``."""
        ...


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when present, else ``cpu``; an explicit ``cuda`` without CUDA is an error."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"reward device {device!r} asked for, but no CUDA device is visible")
    return device


def load_document_frequency(document_frequency: DocumentFrequency | str | os.PathLike) -> DocumentFrequency:
    """A ``DocumentFrequency`` as given, or loaded from the JSON ``DocumentFrequency.save`` wrote."""
    if isinstance(document_frequency, str | os.PathLike):
        document_frequency = DocumentFrequency.load(document_frequency)
    if not isinstance(document_frequency, DocumentFrequency):
        raise TypeError(
            "document_frequency must be a DocumentFrequency or the path of one saved with "
            f"DocumentFrequency.save, got {type(document_frequency).__name__}"
        )
    return document_frequency


def task_reward(reward: RewardConfig, document_frequency: DocumentFrequency | None) -> Metric:
    """The task score metric of ``reward`` with fixed CIDEr-D document frequencies."""
    return get_metric("task_score", bleu_weight=reward.bleu_weight, sigma=reward.cider_sigma, df=document_frequency)


def _check_lengths(sources: Sequence[str], candidates: Sequence[str], references) -> None:
    if len(sources) != len(candidates):
        raise ValueError(f"{len(sources)} sources for {len(candidates)} candidates")
    if references is not None and len(references) != len(candidates):
        raise ValueError(f"{len(references)} reference lists for {len(candidates)} candidates")


class MetricReward:
    """A reference metric as a reward: ``metric.per_sample(candidates, references)``."""

    needs_references = True

    def __init__(self, metric: Metric, name: str | None = None) -> None:
        self.metric = metric
        self.name = name or getattr(metric, "name", type(metric).__name__)

    def score(self, sources, candidates, references=None, fields=None) -> np.ndarray:
        _check_lengths(sources, candidates, references)
        if references is None:
            raise ValueError(f"reward term {self.name!r} is a reference metric: it needs references (reference-free "
                             "terms: reward_model, classifier, or an http reward that needs none)")
        if not candidates:
            return np.zeros(0, dtype=np.float64)
        return np.asarray(self.metric.per_sample(list(candidates), [list(r) for r in references]), dtype=np.float64)


class RewardModelReward:
    """A learned reward model's score. ``root`` is the checkpoint root the model came from (None for a plain
    directory): the reward server watches it and serves a retrained model as :meth:`with_model`'s copy of the
    term, swapped in between requests."""

    needs_references = False

    def __init__(self, path: str | os.PathLike, *, batch_size: int = 64, device: str = "cpu") -> None:
        from rlt2t.common.checkpoint import MARKER
        from rlt2t.common.reward_model import load_reward_model

        given = Path(path)
        self.device = device
        self.batch_size = batch_size
        self.root = given if given.is_dir() and not (given / "config.json").is_file() and not (
            given / MARKER).is_file() else None
        self.model: RewardModel = load_reward_model(given, device=device)

    def with_model(self, model: RewardModel) -> RewardModelReward:
        """A copy of this term serving ``model`` (this one keeps its own: what still scores with it is not
        changed under it)."""
        term = copy.copy(self)
        term.model = model.to(self.device).eval()
        return term

    def load(self, path: str | os.PathLike) -> RewardModel:
        """Load a reward model the way this term does (for hot reload: load, then :meth:`with_model`)."""
        from rlt2t.common.reward_model import load_reward_model

        return load_reward_model(path, device=self.device)

    @property
    def version(self) -> int:
        return self.model.version

    def score(self, sources, candidates, references=None, fields=None) -> np.ndarray:
        _check_lengths(sources, candidates, references)
        model = self.model  # one model for the whole call, even if a reload lands meanwhile
        return model.score(list(sources), list(candidates), batch_size=self.batch_size)


class ClassifierReward:
    """A sequence classifier's probability / log-probability / logit of one label, of the candidate alone or
    of the (source, candidate) pair."""

    needs_references = False

    def __init__(self, term: ClassifierTerm, *, device: str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification

        from rlt2t.common.checkpoint import resolve_model_dir
        from rlt2t.common.tokenization import load_tokenizer

        path = resolve_model_dir(term.path)
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(device).eval()
        self.tokenizer = load_tokenizer(path)
        self.term = term
        self.device = device
        id2label = {int(k): str(v) for k, v in (self.model.config.id2label or {}).items()}
        self.label = class_index(id2label, term.label, "label", str(path))
        self._inputs = set(inspect.signature(self.model.forward).parameters)

    def score(self, sources, candidates, references=None, fields=None) -> np.ndarray:
        import torch

        _check_lengths(sources, candidates, references)
        with torch.inference_mode():
            return self._score(sources, candidates)

    def _score(self, sources, candidates) -> np.ndarray:
        t = self.term
        out = np.zeros(len(candidates), dtype=np.float64)
        for first in range(0, len(candidates), t.batch_size):
            cands = list(candidates[first : first + t.batch_size])
            if t.text == "pair":
                enc = self.tokenizer(list(sources[first : first + t.batch_size]), cands, truncation="longest_first",
                                     max_length=t.max_length, padding=True, return_tensors="pt")
            else:
                enc = self.tokenizer(cands, truncation=True, max_length=t.max_length, padding=True, return_tensors="pt")
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items() if k in self._inputs}).logits.float()
            if t.output == "logit":
                values = logits[:, self.label]
            else:
                values = logits.log_softmax(dim=-1)[:, self.label]
                if t.output == "probability":
                    values = values.exp()
            out[first : first + len(cands)] = values.double().cpu().numpy()
        return out


class HttpReward:
    """A metric or named reward computed by a reward server's ``POST /v1/reward``.

    Retries a refused connection or a 503 (honouring ``Retry-After``) up to 3 times; anything else fails
    with the server's status and message.
    """

    def __init__(self, term: HttpTerm, *, transport: httpx.BaseTransport | None = None) -> None:
        self.term = term
        # Whether the server's reward needs references is the server's business: send them when given.
        self.needs_references = term.name in available_metrics()
        token = os.environ.get(term.token_env)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=term.url.rstrip("/"), timeout=term.timeout_s, headers=headers,
                                   transport=transport)

    def _post(self, body: dict) -> list[float]:
        for attempt in range(4):
            try:
                r = self.client.post("/v1/reward", json=body)
            except httpx.TransportError as e:
                if attempt == 3:
                    raise RuntimeError(f"reward server {self.term.url}: {e}") from e
                time.sleep(0.5 * 2**attempt)
                continue
            if r.status_code == 503 and attempt < 3:
                time.sleep(min(float(r.headers.get("Retry-After", 0.5 * 2**attempt)), 10.0))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"reward server {self.term.url}: HTTP {r.status_code}: {r.text[:500]}")
            scores = r.json()["scores"][self.term.name]
            if len(scores) != len(body["candidates"]):
                raise RuntimeError(f"reward server {self.term.url} returned {len(scores)} scores for "
                                   f"{len(body['candidates'])} candidates")
            return scores
        raise AssertionError("unreachable")

    def score(self, sources, candidates, references=None, fields=None) -> np.ndarray:
        _check_lengths(sources, candidates, references)
        out: list[float] = []
        step = self.term.batch_size
        for first in range(0, len(candidates), step):
            body: dict = {"candidates": list(candidates[first : first + step]),
                          "sources": list(sources[first : first + step]), "metrics": [self.term.name]}
            if references is not None:
                body["references"] = [list(r) for r in references[first : first + step]]
            out += self._post(body)
        return np.asarray(out, dtype=np.float64)


class WeightedReward:
    """Σ weight·term: what :func:`build_reward` returns; ``terms`` holds (weight, name, reward) triples."""

    def __init__(self, terms: Sequence[tuple[float, str, Reward]]) -> None:
        if not terms:
            raise ValueError("a reward needs at least one term")
        self.terms = list(terms)
        self.needs_references = any(r.needs_references for w, _, r in self.terms if w != 0)

    def score(self, sources, candidates, references=None, fields=None) -> np.ndarray:
        return sum(self.score_terms(sources, candidates, references, fields).values(), np.zeros(len(candidates)))

    def score_terms(self, sources, candidates, references=None, fields=None) -> dict[str, np.ndarray]:
        """Each term's weighted contribution [N], by term name (``metric:task_score``, ``reward_model``, ...)."""
        _check_lengths(sources, candidates, references)
        if fields is not None and len(fields) != len(candidates):
            raise ValueError(f"{len(fields)} field rows for {len(candidates)} candidates")
        return {name: weight * reward.score(sources, candidates, references, fields)
                for weight, name, reward in self.terms if weight != 0}


def _metric_params(term: MetricTerm, cfg: RewardConfig, df: DocumentFrequency | None) -> dict:
    params = dict(term.params)
    if term.name == "task_score":
        params.setdefault("bleu_weight", cfg.bleu_weight)
    if term.name in _CIDER_METRICS:
        params.setdefault("sigma", cfg.cider_sigma)
        params.setdefault("df", df)
    return params


def build_term(term: RewardTerm, cfg: RewardConfig, *, document_frequency: DocumentFrequency | None = None,
               device: str = "cpu", where: str = "reward.terms") -> Reward:
    """The reward of one configured term (unweighted)."""
    if isinstance(term, MetricTerm):
        if term.name not in available_metrics():
            raise ValueError(f"{where}: unknown metric {term.name!r}; known: {', '.join(available_metrics())}")
        return MetricReward(get_metric(term.name, **_metric_params(term, cfg, document_frequency)), term.name)
    if isinstance(term, RewardModelTerm):
        return RewardModelReward(term.path, batch_size=term.batch_size, device=device)
    if isinstance(term, ClassifierTerm):
        return ClassifierReward(term, device=device)
    if isinstance(term, HttpTerm):
        return HttpReward(term)
    if isinstance(term, PythonTerm):
        return PythonReward(term, term_name(term), where)
    raise TypeError(f"{where}: unknown reward term {type(term).__name__}")


def term_name(term: RewardTerm) -> str:
    if isinstance(term, MetricTerm | HttpTerm):
        return f"{term.kind}:{term.name}"
    if isinstance(term, PythonTerm):
        return f"python:{term.model_dump(include={'fn'})['fn']}"
    if isinstance(term, ClassifierTerm):
        return f"classifier:{term.label}"
    return term.kind


def build_reward(cfg: RewardConfig, *, document_frequency: DocumentFrequency | None = None, device: str = "cpu",
                 terms: Sequence[RewardTerm] | None = None, where: str = "reward.terms") -> WeightedReward:
    """The reward ``cfg.terms`` (or ``terms``, e.g. one of ``cfg.named``) describe: Σ weight·term.

    ``document_frequency`` is the CIDEr-D table of task_score / cider_d terms (None: counted from each
    call's references); learned terms are loaded once and run on ``device`` (``auto`` resolves). Errors name
    each term as ``where[i]``.
    """
    terms = cfg.terms if terms is None else terms
    load_plugins(cfg.plugins)
    if any(isinstance(t, RewardModelTerm | ClassifierTerm) for t in terms):
        device = resolve_device(device)  # reference metrics and HTTP terms run on no device
    built = []
    names: dict[str, int] = {}
    for i, term in enumerate(terms):
        name = term_name(term)
        names[name] = names.get(name, 0) + 1
        if names[name] > 1:
            name = f"{name}#{names[name]}"
        built.append((term.weight, name, build_term(term, cfg, document_frequency=document_frequency, device=device,
                                                    where=f"{where}[{i}]")))
    return WeightedReward(built)


def local_reward(cfg: RewardConfig, reference_sets: Sequence[Sequence[str]]) -> Callable[..., np.ndarray]:
    """The score function of the reward ``cfg`` describes, built in this process (learned terms on
    ``reward.device``; a term whose function does not import fails here), CIDEr-D's document frequencies counted
    from ``reference_sets`` (the training references, as the RL job's) when a term needs them: how a stage without
    reward workers (SFT, offline RL) scores ``metric.monitor=reward``."""
    check_reward(cfg)
    df = DocumentFrequency.from_references(reference_sets) if needs_document_frequency(cfg) else None
    return build_reward(cfg, document_frequency=df, device=cfg.device).score


def _all_terms(cfg: RewardConfig) -> Iterator[tuple[str, RewardTerm]]:
    """Every configured term with its key: ``reward.terms[i]``, ``reward.named.<name>[i]``."""
    for i, term in enumerate(cfg.terms):
        yield f"reward.terms[{i}]", term
    for name, terms in cfg.named.items():
        for i, term in enumerate(terms):
            yield f"reward.named.{name}[{i}]", term


def missing_dependencies(terms: Sequence[RewardTerm], where: str = "reward.terms") -> list[str]:
    """One line per term of ``terms`` whose metric needs data or a package this machine lacks (METEOR without
    WordNet): ``where[i] (metric:meteor): what is missing; the command that installs it``. Checks files, builds
    nothing (:func:`rlt2t.common.metrics.missing_dependency`); learned, HTTP and Python terms are not checked."""
    return [f"{where}[{i}] ({term_name(term)}): {reason}" for i, term in enumerate(terms)
            if isinstance(term, MetricTerm) and (reason := missing_dependency(term.name, **term.params)) is not None]


def check_reward(cfg: RewardConfig) -> None:
    """What a job checks before it starts a worker: the plugins import, every Python term's function resolves,
    every metric term names a registered metric, and, of ``reward.terms`` (what the job scores with; a named reward
    is the reward server's, which leaves it out when it cannot run), the metrics have their data and packages and
    each learned term's path holds a model of its kind (a classifier's label one of its classes); ConfigError
    naming the term and the path, or what to install, otherwise."""
    load_plugins(cfg.plugins)
    for where, term in _all_terms(cfg):
        if isinstance(term, PythonTerm):
            term_function(term, f"{where} ({term_name(term)})")
        elif isinstance(term, MetricTerm) and term.name not in available_metrics():
            raise ConfigError(f"{where}: unknown metric {term.name!r}; known: {', '.join(available_metrics())} "
                              "(a metric of your own: register it in a module listed in reward.plugins)")
    for i, term in enumerate(cfg.terms):
        if isinstance(term, RewardModelTerm | ClassifierTerm):
            _check_learned_term(term, f"reward.terms[{i}]")
    if missing := missing_dependencies(cfg.terms):
        raise ConfigError("; ".join(missing))


def _check_learned_term(term: RewardModelTerm | ClassifierTerm, where: str) -> None:
    """A learned term's path is a model of its kind and a classifier's label one of its classes: read from the
    saved files without loading the model (the workers load it, on Ray after its start-up)."""
    from rlt2t.common.checkpoint import resolve_model_dir
    from rlt2t.common.reward_model import SPEC_FILE, is_reward_model_dir

    try:
        path = resolve_model_dir(term.path)
    except FileNotFoundError as e:
        raise ConfigError(f"{where}.path: {e}") from None
    if isinstance(term, RewardModelTerm):
        if not is_reward_model_dir(path):
            raise ConfigError(f"{where}.path: {path} is not a reward model (no {SPEC_FILE}); train one with "
                              "`rlt2t reward-model train`")
        return
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}.path: {path} is not a model directory (no config.json)")
    try:
        class_index(saved_id2label(path), term.label, f"{where}.label", str(path))
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class UserRegistrations:
    """The metrics and rewards a reward config names that this process registered beyond the built-ins (a script's
    ``@register_metric``, plugins): a Ray worker's fresh interpreter has only the built-in ones, so the job ships
    these to its reward workers, which :meth:`install` them before building the reward. Functions defined in
    ``__main__`` travel by value, the others by reference (their module must import on the worker)."""

    metrics: dict[str, MetricFactory] = field(default_factory=dict)
    rewards: dict[str, RewardFn] = field(default_factory=dict)

    @classmethod
    def used_by(cls, cfg: RewardConfig) -> UserRegistrations:
        """Only what ``cfg``'s terms (and named rewards) name: nothing else needs to reach, or import on, a
        worker."""
        terms = [t for _, t in _all_terms(cfg)]
        metrics = {t.name for t in terms if isinstance(t, MetricTerm)}
        rewards = {t.fn for t in terms if isinstance(t, PythonTerm) and isinstance(t.fn, str)}
        return cls({n: f for n, f in user_metrics().items() if n in metrics},
                   {n: f for n, f in registered_rewards().items() if n in rewards})

    def install(self) -> None:
        for name, factory in self.metrics.items():
            register_metric(name, replace=True)(factory)
        for name, fn in self.rewards.items():
            register_reward(name, replace=True)(fn)


def reference_readers(cfg: RewardConfig) -> list[str]:
    """What of the reward ``cfg`` describes reads each row's references, one entry per weighted term
    (``reward.terms[0] (metric:task_score)``; ``reward.source=http`` scores by the server's task score): empty
    when every term scores a candidate without them (python, reward_model, classifier, or an http term naming one
    of the reward server's named rewards), so that RL can train on rows without targets. Python terms count as
    reference-free: such a function gets an empty reference list for an unlabeled row."""
    if cfg.source == "http":
        return ["reward.source=http (the reward server's task_score)"]
    load_plugins(cfg.plugins)  # a metric of the user's, which an http term may name
    metrics = available_metrics()
    return [f"reward.terms[{i}] ({term_name(t)})" for i, t in enumerate(cfg.terms)
            if t.weight and (isinstance(t, MetricTerm) or (isinstance(t, HttpTerm) and t.name in metrics))]


def needs_document_frequency(cfg: RewardConfig) -> bool:
    """True when a term of ``cfg.terms`` is task_score or CIDEr-D without its own ``df`` param."""
    return any(isinstance(t, MetricTerm) and t.name in _CIDER_METRICS and "df" not in t.params for t in cfg.terms)


def score_pairs(reward: Reward | Metric, sets: Sequence[CandidateSet]) -> list[ScoredPair]:
    """One scored pair per set, in order; all 2·len(sets) candidates are scored in one reward call.

    A bare ``Metric`` is scored as a :class:`MetricReward` (the policy server's ``/v1/pairs`` passes one).
    """
    if not isinstance(reward, Reward):
        reward = MetricReward(reward)
    hyps = [text for s in sets for text in s.pair]
    sources = [s.source for s in sets for _ in range(2)]
    refs = [list(s.refs) for s in sets for _ in range(2)]
    fields = [s.fields for s in sets for _ in range(2)]
    scores = reward.score(sources, hyps, refs, fields).tolist() if hyps else []
    for i, value in enumerate(scores):
        if not math.isfinite(value):
            raise FloatingPointError(f"reward of candidate {hyps[i]!r} (example {sets[i // 2].example_id!r}) is "
                                     f"{value}")
    return [order_pair(s, scores[2 * i], scores[2 * i + 1]) for i, s in enumerate(sets)]


def score_groups(reward: Reward | Metric, groups: Sequence[SampledGroup]) -> list[ScoredGroup]:
    """The reward of every sample (and greedy decode) of each group, all in one reward call."""
    if not isinstance(reward, Reward):
        reward = MetricReward(reward)
    hyps: list[str] = []
    sources: list[str] = []
    refs: list[list[str]] = []
    fields: list[Mapping[str, Any]] = []
    for g in groups:
        texts = list(g.candidates) + ([g.greedy] if g.greedy is not None else [])
        hyps += texts
        sources += [g.source] * len(texts)
        refs += [list(g.refs)] * len(texts)
        fields += [g.fields] * len(texts)
    scores = reward.score(sources, hyps, refs, fields).tolist() if hyps else []
    for i, value in enumerate(scores):
        if not math.isfinite(value):
            raise FloatingPointError(f"reward of candidate {hyps[i]!r} is {value}")
    out, pos = [], 0
    for g in groups:
        k = len(g.candidates)
        greedy = scores[pos + k] if g.greedy is not None else None
        out.append(ScoredGroup(group=g, rewards=tuple(scores[pos : pos + k]), greedy_reward=greedy))
        pos += k + (g.greedy is not None)
    return out


def order_pair(s: CandidateSet, score_first: float, score_second: float) -> ScoredPair:
    """The scored pair of ``s`` given the scores of its two drawn candidates: better first, ties kept in
    draw order, ``use_rank`` off for equal strings or tied scores."""
    first, second = s.pair
    if score_second > score_first:
        first, second, score_first, score_second = second, first, score_second, score_first
    return ScoredPair(
        example_id=s.example_id,
        source=s.source,
        reference=s.reference,
        a=first,
        b=second,
        score_a=score_first,
        score_b=score_second,
        # A tie is exact float equality: the metric is deterministic, so equal texts (or texts the metric
        # cannot tell apart) score bit-identically.
        use_rank=first != second and score_first != score_second,
        policy_version=s.policy_version,
    )
