"""The reward server: per-sample metric scores of candidates against references over HTTP.

    app = create_app(cfg, document_frequency="runs/exp1/rl/document_frequency.json")

``POST /v1/reward`` takes candidates, one reference (or a list of references) per candidate and metric
names from the registry (``rlt2t.common.metrics.available_metrics()``; default ``task_score``). The task
score and CIDEr-D use ``reward.bleu_weight`` and ``reward.cider_sigma`` and the CIDEr-D document
frequencies of ``document_frequency`` when given, else frequencies counted over the request's own
references (then an item's CIDEr-D depends on the rest of the request, as in the coco evaluator).

Learned rewards are served by name: ``reward.named`` maps a name to reward terms (reward models,
classifiers, Python functions, metrics, weighted; ``rlt2t.common.rewards``); a request naming one gives ``sources`` (and
``references`` when one of its terms is a metric). A reward model given as a checkpoint root is hot-reloaded
when a newer complete checkpoint appears (``rlt2t.services.learned_rewards``): the new models serve from the
next request on, every part of a request is scored by the models it started with, and the response names their
versions (``reward_model_versions``). Their task score and CIDEr-D terms use the metrics' document frequencies
(the table, else the whole request's references).

Limits: at most ``serve.max_sources_per_call × serve.max_candidates_per_source`` candidates per request
and ``serve.max_tokens_per_source`` whitespace tokens per text (the metrics tokenise on whitespace).
When the run has a tokenizer (``{run}/tokenizer``), every text obeys its token rule (``text_checker``,
as the data loader: an ``ids`` vocabulary takes data tokens and <sep> only; no kind takes other special
tokens). Unknown metric names are 422s naming ``metrics[i]``, and so are registered metrics that need constructor
arguments a request cannot give (``classifier_accuracy``'s classifier: serve it as a ``reward.named`` metric term).

Dependencies are checked at start-up: a metric whose data or package is missing on this machine (METEOR without
Debian's ``wordnet-base``; ``rlt2t.common.metrics.missing_dependency``), and a named reward with such a metric term,
is not offered. The start-up log warns of each with what to install, ``GET /v1/metrics`` lists it under
``unavailable`` with the same words, and a request naming it is a 422 at ``metrics[i]`` saying so (a restart after
installing offers it), never a 500 from the first call that builds it.

Work is bounded like the policy server's (``rlt2t.services.batching``): a request's cost is Σ over its
candidates and their references of (candidate tokens + 1) × (reference tokens + 1) plus their characters,
times the number of metrics (ROUGE-L's table; chrF's character n-grams); above ``serve.max_reward_cost`` it is
a 422 naming the product, queued work above ``serve.max_reward_queue_cost`` a 503 + Retry-After. Scoring runs
on one worker thread, off the event loop, in parts of at most ``serve.max_reward_call_cost``; a request whose
client disconnected or whose ``serve.request_timeout_s`` passed is dropped between parts. The server's speed is
calibrated at start-up on the task score (:func:`calibrate_reward`) and updated from the calls it serves; a request
predicted to take longer than ``serve.request_timeout_s`` is refused at once (429 naming the prediction and the
limit; 503 + Retry-After when only the queued work is in its way), as on the policy server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from rlt2t.common.config import Config
from rlt2t.common.metrics import DocumentFrequency, available_metrics, get_metric, missing_dependency
from rlt2t.common.python_rewards import RewardError
from rlt2t.common.tokenization import load_tokenizer, text_checker
from rlt2t.services.admission import ServiceTime, Work
from rlt2t.services.batching import Batcher, CallControl
from rlt2t.services.http import (
    BODY_REFUSED,
    OVERLOADED,
    UNAUTHORIZED,
    CheckThread,
    ErrorJSONResponse,
    ServiceMetrics,
    add_common_routes,
    auth_dependencies,
    disconnected,
    field_error,
    install_error_handlers,
    install_middleware,
    load_token,
)
from rlt2t.services.learned_rewards import NamedRewards, Snapshot
from rlt2t.services.schemas import ErrorResponse, RewardMetrics, RewardRequest, RewardResponse, reference_lists

log = logging.getLogger("rlt2t.services.reward")


def metric_params(name: str, cfg: Config, df: DocumentFrequency | None) -> dict:
    """Keyword params of a registered metric: the reward config for the task score and CIDEr-D."""
    if name == "task_score":
        return {"bleu_weight": cfg.reward.bleu_weight, "sigma": cfg.reward.cider_sigma, "df": df}
    if name == "cider_d":
        return {"sigma": cfg.reward.cider_sigma, "df": df}
    return {}


class _OwnFrequencies:
    """A request's own CIDEr-D document frequencies, as (part of) a batching key: requests scored with
    their own frequencies never share a call."""

    def __init__(self, df: DocumentFrequency) -> None:
        self.df = df


class _Scorer:
    """The reward server's "backend" for the batcher: scores (candidate, references, source) items per metric or
    named (learned) reward, the latter with one snapshot of their reward models (a hot reload builds a new
    scorer and swaps it in through the batcher: every part of a request is scored by the same models)."""

    def __init__(self, cfg: Config, fixed_df: DocumentFrequency | None, named: NamedRewards,
                 rewards: Snapshot) -> None:
        self.cfg, self.fixed_df, self.named, self.rewards = cfg, fixed_df, named, rewards

    def score(self, key: tuple[tuple[str, ...], _OwnFrequencies | None],
              items: list[tuple[str, list[str] | None, str | None]]) -> list[dict[str, float]]:
        names, own = key
        df = own.df if own is not None else self.fixed_df
        hyps = [c for c, _, _ in items]
        given = [r for _, r, _ in items if r is not None]
        refs = given if len(given) == len(items) else None
        sources = [s for _, _, s in items]
        columns = {}
        for name in names:
            if name in self.rewards:
                columns[name] = self.named.score(name, sources, hyps, refs, rewards=self.rewards,  # type: ignore[arg-type]
                                                 document_frequency=df).tolist()
            else:
                assert refs is not None, "a request for a registered metric has references (checked at the route)"
                columns[name] = get_metric(name, **metric_params(name, self.cfg, df)).per_sample(hyps, refs).tolist()
        return [{name: columns[name][i] for name in names} for i in range(len(items))]

    def model_versions(self, names: Sequence[str]) -> dict[str, dict[str, int]]:
        """Named reward among ``names`` → its reward-model terms' versions (rewards without one left out)."""
        versions = {name: NamedRewards.model_versions(self.rewards[name]) for name in names if name in self.rewards}
        return {name: v for name, v in versions.items() if v}

    def close(self) -> None:
        """Nothing to release."""


def _build_problem(name: str, cfg: Config, df: DocumentFrequency | None) -> str | None:
    """Why the registered metric ``name`` cannot be built with the server's settings (it needs constructor
    arguments, e.g. classifier_accuracy's classifier; it lacks data or a package its ``missing_dependency`` does
    not declare), or None."""
    try:
        get_metric(name, **metric_params(name, cfg, df))
    except TypeError as e:
        return f"{name!r} needs parameters a request cannot give ({e}); serve it as a reward.named metric term " \
               "with its params"
    except (ImportError, OSError) as e:
        return f"{name!r} cannot be built on this server ({type(e).__name__}: {e})"
    return None


def _not_offered(cfg: Config, df: DocumentFrequency | None, named: NamedRewards) -> dict[str, str]:
    """Registered metric or named reward → what it needs and this machine lacks, with the command that installs
    it: what the server does not offer. Checks files, builds nothing."""
    metrics = {name: reason for name in available_metrics()
               if (reason := missing_dependency(name, **metric_params(name, cfg, df))) is not None}
    return {**metrics, **named.unavailable}


def _run_reward(scorer: _Scorer, key, items: list, control: CallControl) -> list[dict[str, float]]:
    return scorer.score(key, items)  # metrics have no decoding steps: a call is stopped between parts


def calibrate_reward(scorer: _Scorer) -> list[tuple[Work, float]]:
    """The task score of synthetic candidates against references, in calls of 1 to 64 items of 8 to 128 words,
    timed: what the service-time model is fitted to at start-up (a fraction of a second). A metric scored far
    slower per unit of work (a reward model's forward pass, METEOR) is learned from the calls that serve it."""
    samples = []
    for items, words in ((1, 8), (1, 8), (16, 16), (64, 32), (16, 128)):  # the first: a warm-up, not kept
        hyps = [" ".join(str((i + j) % 97) for j in range(words)) for i in range(items)]
        refs = [[" ".join(str((3 * i + j) % 89) for j in range(words))] for i in range(items)]
        own = _OwnFrequencies(DocumentFrequency.from_references(refs)) if scorer.fixed_df is None else None
        started = time.perf_counter()
        scorer.score((("task_score",), own), [(h, r, None) for h, r in zip(hyps, refs, strict=True)])
        seconds = time.perf_counter() - started
        samples.append((Work(steps=1, rows=float(sum(reward_cost(h, r, 1) for h, r in zip(hyps, refs, strict=True)))),
                        seconds))
    return samples[1:]


def reward_cost(candidate: str, references: Sequence[str], num_metrics: int, source: str = "") -> int:
    """Work estimate of one item: Σ_refs ((candidate tokens + 1) × (reference tokens + 1) + their characters),
    × metrics: ROUGE-L's table, and the character n-grams of chrF; without references (a learned reward) the
    source and candidate characters (what a reward model reads)."""
    n = len(candidate.split()) + 1
    if not references:
        return num_metrics * (n + len(candidate) + len(source))
    return num_metrics * sum(n * (len(r.split()) + 1) + len(candidate) + len(r) for r in references)


def create_app(cfg: Config, *, document_frequency: str | Path | None = None) -> FastAPI:
    """The reward server app; ``document_frequency`` is a JSON written by ``DocumentFrequency.save``."""
    serve = cfg.serve
    fixed_df = DocumentFrequency.load(document_frequency) if document_frequency is not None else None
    token = load_token(serve)
    protected = auth_dependencies(token)
    metrics = ServiceMetrics("rlt2t_reward")
    max_items = serve.max_sources_per_call * serve.max_candidates_per_source
    # The run's token rule, when the run has a tokenizer (the rule of its data files).
    check_tokens = text_checker(load_tokenizer(cfg.tokenizer_dir)) if cfg.tokenizer_dir.is_dir() else None
    named = NamedRewards(cfg, document_frequency=fixed_df)  # reward.named: learned rewards, hot-reloaded
    batcher = Batcher(_Scorer(cfg, fixed_df, named, named.rewards), max_batch_size=max_items, max_wait_ms=0,
                      max_queue_cost=serve.max_reward_queue_cost, max_call_cost=serve.max_reward_call_cost,
                      timing=ServiceTime(), calibration=calibrate_reward, request_timeout_s=serve.request_timeout_s,
                      timing_key=lambda key: key[0])  # a model per metric set: a reward model is far slower per unit
    named.on_reload = lambda rewards: batcher.swap_backend(_Scorer(cfg, fixed_df, named, rewards))
    metrics.track_service_time(lambda: batcher.timing)
    problems: dict[str, str | None] = {}  # registered metric -> why it cannot be built (None: it can)
    unavailable = _not_offered(cfg, fixed_df, named)  # not offered: the first call would fail on what is missing
    for name, reason in unavailable.items():
        log.warning("reward server: %r is not offered: %s", name, reason)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        named.start()
        batcher.start()
        await run_in_threadpool(batcher.wait_calibrated, 60.0)  # requests wait for it: admission needs the speed
        try:
            yield
        finally:
            batcher.stop()
            named.stop()

    app = FastAPI(title="rlt2t reward server", version="1", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.named_rewards = named
    install_error_handlers(app, metrics)
    install_middleware(app, metrics, serve, token)

    @app.exception_handler(RewardError)
    async def reward_failed(request: Request, exc: RewardError) -> ErrorJSONResponse:
        # A Python reward term of reward.named raised or returned what is not a score: say which and where.
        log.error("%s", exc)
        return ErrorJSONResponse({"detail": str(exc)}, status_code=500)
    add_common_routes(app, metrics, lambda: "shutting down" if batcher.stopping else True, protected)

    checks = CheckThread()

    def check_text(loc: tuple, text: str) -> None:
        n = len(text.split())
        if n > serve.max_tokens_per_source:
            raise field_error(loc, f"{n} tokens; at most {serve.max_tokens_per_source} (serve.max_tokens_per_source)")
        if check_tokens is not None and (problem := check_tokens(text)) is not None:
            raise field_error(loc, problem, text)

    def check_texts(req: RewardRequest) -> None:
        """Every text of a request, on the check thread (``checks.run``): the token rule tokenizes."""
        for i, text in enumerate(req.candidates):
            check_text(("body", "candidates", i), text)
        for i, text in enumerate(req.sources or ()):
            check_text(("body", "sources", i), text)
        for i, given in enumerate(req.references or ()):
            if isinstance(given, str):
                check_text(("body", "references", i), given)
            else:
                for j, text in enumerate(given):
                    check_text(("body", "references", i, j), text)

    @app.post("/v1/reward", response_model=RewardResponse, dependencies=protected, tags=["reward"],
              responses={**(UNAUTHORIZED if token else {}), **OVERLOADED, **BODY_REFUSED,
                         500: {"model": ErrorResponse, "description": "A Python reward of reward.named raised, or "
                               "returned what is not one finite number per candidate: the detail names the term, "
                               "the error and the candidate's source"}})
    async def reward(req: RewardRequest, request: Request) -> RewardResponse:
        """Per-sample scores of each candidate for each requested metric."""
        n = len(req.candidates)
        if n > max_items:
            raise field_error(("body", "candidates"), f"{n} candidates; at most {max_items} "
                              "(serve.max_sources_per_call x serve.max_candidates_per_source)")
        if req.references is not None and len(req.references) != n:
            raise field_error(("body", "references"), f"{len(req.references)} references for {n} candidates")
        if req.sources is not None and len(req.sources) != n:
            raise field_error(("body", "sources"), f"{len(req.sources)} sources for {n} candidates")
        known = set(available_metrics()) | set(named.names())
        for i, name in enumerate(req.metrics):
            if name in unavailable:
                raise field_error(("body", "metrics", i), f"{name!r} is not offered by this server: "
                                  f"{unavailable[name]}; a restart offers it once installed", name)
            if name not in known:
                offered = sorted(known - set(unavailable))
                raise field_error(("body", "metrics", i), f"unknown metric {name!r}; known: {', '.join(offered)}", name)
            if name not in named.rewards:
                if name not in problems:  # built once, off the event loop (METEOR reads WordNet)
                    problems[name] = await run_in_threadpool(_build_problem, name, cfg, fixed_df)
                if (problem := problems[name]) is not None:
                    raise field_error(("body", "metrics", i), problem, name)
            if req.references is None and (name not in named.rewards or named.needs_references(name)):
                raise field_error(("body", "references"), f"{name!r} needs references")
            if req.sources is None and name in named.rewards:
                raise field_error(("body", "sources"), f"the reward {name!r} scores (source, candidate) pairs: give "
                                  "sources")
        if len(set(req.metrics)) != len(req.metrics):
            raise field_error(("body", "metrics"), "metric names repeat")
        refs = reference_lists(req.references) if req.references is not None else None
        await checks.run(check_texts, req)

        sources = list(req.sources) if req.sources is not None else [None] * n
        item_refs = refs if refs is not None else [None] * n
        costs = [reward_cost(c, r or [], len(req.metrics), s or "")
                 for c, r, s in zip(req.candidates, item_refs, sources, strict=True)]
        if (total := sum(costs)) > serve.max_reward_cost:
            average = sum(map(len, refs)) / n if refs is not None else 0.0
            raise field_error(("body",), f"work {n} candidates x {average:.1f} references on average "
                              f"x ((candidate tokens + 1) x (reference tokens + 1) + characters) x {len(req.metrics)} "
                              "metrics = "
                              f"{total}; at most {serve.max_reward_cost} per request (serve.max_reward_cost)")
        own = None
        if fixed_df is None and refs is not None:  # counted over the request's references, off the event loop
            own = _OwnFrequencies(await run_in_threadpool(DocumentFrequency.from_references, refs))
        items = list(zip(req.candidates, item_refs, sources, strict=True))
        results, scorer = await batcher.submit((tuple(req.metrics), own), items,
                                               _run_reward, costs=costs, gone=disconnected(request),
                                               deadline=request.state.arrived + serve.request_timeout_s,
                                               describe=f"{n} candidates, {len(req.metrics)} metrics, work {total}",
                                               reduce="fewer or shorter candidates or references, or fewer metrics; "
                                                      "an operator may raise serve.request_timeout_s")
        assert scorer is not None  # None only for a request without items
        return RewardResponse(scores={name: [r[name] for r in results] for name in req.metrics},
                              reward_model_versions=scorer.model_versions(req.metrics))

    @app.get("/v1/metrics", response_model=RewardMetrics, dependencies=protected, tags=["reward"],
             responses=UNAUTHORIZED if token else {})
    async def offered_metrics() -> RewardMetrics:
        """What a request's ``metrics`` may name, and what this server does not offer and why."""
        for name in available_metrics():
            if name not in unavailable and name not in problems:  # built once, off the event loop, as a request does
                problems[name] = await run_in_threadpool(_build_problem, name, cfg, fixed_df)
        refused = {name: problem for name, problem in problems.items() if problem is not None}
        return RewardMetrics(
            metrics=[n for n in available_metrics() if n not in unavailable and n not in refused],
            named=named.names(), unavailable=dict(sorted({**unavailable, **refused}.items())))

    return app
