"""The reward server: per-sample metric scores of candidates against references over HTTP.

    app = create_app(cfg, document_frequency="runs/exp1/rl/document_frequency.json")

``POST /v1/reward`` takes candidates, one reference (or a list of references) per candidate and metric
names from the registry (``rlt2t.common.metrics.available_metrics()``; default ``task_score``). The task
score and CIDEr-D use ``reward.bleu_weight`` and ``reward.cider_sigma`` and the CIDEr-D document
frequencies of ``document_frequency`` when given, else frequencies counted over the request's own
references (then an item's CIDEr-D depends on the rest of the request, as in the coco evaluator).

Learned rewards are served by name: ``reward.named`` maps a name to reward terms (reward models,
classifiers, metrics, weighted; ``rlt2t.common.rewards``); a request naming one gives ``sources`` (and
``references`` when one of its terms is a metric). A reward model given as a checkpoint root is hot-reloaded
when a newer complete checkpoint appears (``rlt2t.services.learned_rewards``).

Limits: at most ``serve.max_sources_per_call × serve.max_candidates_per_source`` candidates per request
and ``serve.max_tokens_per_source`` whitespace tokens per text (the metrics tokenise on whitespace;
there is no model tokenizer here). Unknown metric names are 422s naming ``metrics[i]``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from rlt2t.common.config import Config
from rlt2t.common.metrics import DocumentFrequency, available_metrics, get_metric
from rlt2t.services.http import (
    UNAUTHORIZED,
    BodyLimit,
    ServiceMetrics,
    add_common_routes,
    auth_dependencies,
    field_error,
    install_error_handlers,
    load_token,
)
from rlt2t.services.learned_rewards import NamedRewards
from rlt2t.services.schemas import ErrorResponse, RewardRequest, RewardResponse

log = logging.getLogger("rlt2t.services.reward")
# The BodyLimit middleware's answer, documented so clients (and the schema fuzzer) expect it.
BODY_TOO_LARGE = {413: {"model": ErrorResponse, "description": "Body over serve.max_body_bytes"}}


def metric_params(name: str, cfg: Config, df: DocumentFrequency) -> dict:
    """Keyword params of a registered metric: the reward config for the task score and CIDEr-D."""
    if name == "task_score":
        return {"bleu_weight": cfg.reward.bleu_weight, "sigma": cfg.reward.cider_sigma, "df": df}
    if name == "cider_d":
        return {"sigma": cfg.reward.cider_sigma, "df": df}
    return {}


def create_app(cfg: Config, *, document_frequency: str | Path | None = None) -> FastAPI:
    """The reward server app; ``document_frequency`` is a JSON written by ``DocumentFrequency.save``."""
    serve = cfg.serve
    fixed_df = DocumentFrequency.load(document_frequency) if document_frequency is not None else None
    token = load_token(serve)
    protected = auth_dependencies(token)
    metrics = ServiceMetrics("rlt2t_reward")
    max_items = serve.max_sources_per_call * serve.max_candidates_per_source
    named = NamedRewards(cfg, document_frequency=fixed_df)  # reward.named: learned rewards, hot-reloaded

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        named.start()
        try:
            yield
        finally:
            named.stop()

    app = FastAPI(title="rlt2t reward server", version="1", lifespan=lifespan)
    app.state.named_rewards = named
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=cfg.serve.max_body_bytes)
    metrics.install(app)
    add_common_routes(app, metrics, lambda: True, protected)

    def check_text(loc: tuple, text: str) -> None:
        n = len(text.split())
        if n > serve.max_tokens_per_source:
            raise field_error(loc, f"{n} tokens; at most {serve.max_tokens_per_source} (serve.max_tokens_per_source)")

    @app.post("/v1/reward", response_model=RewardResponse, dependencies=protected, tags=["reward"],
              responses={**(UNAUTHORIZED if token else {}), **BODY_TOO_LARGE})
    async def reward(req: RewardRequest) -> RewardResponse:
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
            if name not in known:
                raise field_error(("body", "metrics", i), f"unknown metric {name!r}; known: {', '.join(sorted(known))}",
                                  name)
            if req.references is None and (name not in named.rewards or named.needs_references(name)):
                raise field_error(("body", "references"), f"{name!r} needs references")
            if req.sources is None and name in named.rewards:
                raise field_error(("body", "sources"), f"the reward {name!r} scores (source, candidate) pairs: give "
                                  "sources")
        if len(set(req.metrics)) != len(req.metrics):
            raise field_error(("body", "metrics"), "metric names repeat")
        refs = [[r] if isinstance(r, str) else list(r) for r in req.references] if req.references is not None else None
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

        def score() -> dict[str, list[float]]:
            df = fixed_df if fixed_df is not None or refs is None else DocumentFrequency.from_references(refs)
            return {name: named.score(name, req.sources, req.candidates, refs).tolist() if name in named.rewards
                    else get_metric(name, **metric_params(name, cfg, df)).per_sample(req.candidates, refs).tolist()
                    for name in req.metrics}

        return RewardResponse(scores=await run_in_threadpool(score))

    return app
