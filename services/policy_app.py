"""The policy server: candidates, training pairs and teacher-forced scores over HTTP.

    app = create_app(cfg)                      # serves cfg.serve.checkpoint_dir, hot-reloading it
    uvicorn.run(app, host="127.0.0.1", port=8000)   # or: rlt2t serve policy

Routes (see ``rlt2t.services.schemas`` for the bodies):

- ``POST /v1/candidates``: sampling (top-k / top-p / temperature) or beam search → texts, token ids,
  raw per-token log-probs, and the policy version; ``rerank: mbr`` also picks one per source by minimum Bayes
  risk over its candidates (``rlt2t.common.mbr``; ``utility`` one of the vectorised utilities task_score,
  bleu4, sacrebleu, cider_d; default serve.mbr_utility, checked when the app is created); ``rerank: reward`` the
  candidate a reference-free reward of the config scores highest (``reward``: a name of reward.named, default
  reward.terms; built on its first use, on reward.device, and kept; a reward that cannot be loaded or reads
  references is a 422 on ``reward`` saying why).
- ``POST /v1/pairs``: the rank-RL rollout over HTTP: K samples per source, the gold added,
  deduplicated, a pair drawn and scored with the task score against the source's reference or references,
  ``a`` the better (``rlt2t.common.types.ScoredPair`` fields; ``reference`` is the gold, the first). CIDEr-D
  document frequencies come from ``document_frequency`` (the JSON rank training writes) when given, else from
  the request's own references (one set per source), in which case a pair's scores depend on the other
  references in the request.
- ``POST /v1/score``: teacher-forced per-token log-probs of targets given a source (the rerank primitive).
- ``GET /v1/model``, ``POST /v1/reload`` (serve the newest checkpoint on disk even when older: an
  operator's action), ``/healthz`` (GET/HEAD, no auth), ``/readyz``, ``/metrics``.

Limits: ``serve.max_sources_per_call`` sources (or items) per request; ``serve.max_tokens_per_source``
tokens per text *as the model's tokenizer counts them* (special tokens excluded), further capped by the
model's positions less one (room for EOS); ``serve.max_candidates_per_source`` samples, beam width,
hypotheses or scored targets per source; every text under the tokenizer's token rule
(``text_checker``: an ``ids`` vocabulary takes data tokens and <sep> only; no kind takes other special
tokens). Violations are 422s naming the field (and the item, and the first bad token).

Work: each request's cost is estimated before it is queued, in token positions: rows × (source tokens +
max_new_tokens) for /v1/candidates (rows = sources × candidates, × beam width in beam mode) and
/v1/pairs, Σ (source + target tokens + 1) for /v1/score. Above ``serve.max_request_cost`` it is a 422
naming the product; queued work is bounded by ``serve.max_queue_cost`` (503 + Retry-After), each model call
by ``serve.max_call_cost`` (see ``rlt2t.services.batching``). A request is dropped, queued or running,
when its client disconnects or ``serve.request_timeout_s`` passes (503 + Retry-After). MBR's pair utilities
are not counted in the cost: the server computes only the vectorised ones (``rlt2t.common.mbr.VECTORISED_METRICS``),
a few matrix products over the n-gram counts of at most ``serve.max_candidates_per_source`` candidates of at
most ``max_new_tokens`` tokens per source, small beside the decoding the cost bounds; a metric scored one pair
per call (ROUGE, METEOR, a plugin's) could take far longer and is refused (422 on ``utility``). A reward rerank
scores each distinct candidate once (at most ``serve.max_sources_per_call`` x ``serve.max_candidates_per_source``
texts of at most ``max_new_tokens`` tokens), one request at a time, in the reward's own batches.

Time: the server knows its speed (``rlt2t.services.admission``): calibrated at start-up by a few timed sampling
calls (:func:`calibrate_policy`; requests wait for it), updated from every call it serves. A request predicted to
take longer than ``serve.request_timeout_s`` (every row decoding to ``max_new_tokens``) is refused at once: 429
naming the prediction, the limit and what to ask less of, or 503 + Retry-After when only the queued work is in
its way. After heavy work (half of ``serve.max_call_cost`` since the last time: one call of a maximum-cost
request, even one cut short) the worker hands the freed heap back to the system (``rlt2t.services.memory``).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from prometheus_client import Counter, Gauge, Histogram
from starlette.concurrency import run_in_threadpool

from rlt2t.common.candidates import candidate_set, stable_seed
from rlt2t.common.checkpoint import latest_complete_checkpoint, resolve_model_dir
from rlt2t.common.config import Config
from rlt2t.common.mbr import VECTORISED_METRICS, MetricUtility, PairUtility, mbr_over_entries, metric_utility
from rlt2t.common.metrics import DocumentFrequency, metric_params
from rlt2t.common.python_rewards import RewardError
from rlt2t.common.rerank import check_reference_free
from rlt2t.common.rewards import WeightedReward, build_reward, score_pairs, task_reward
from rlt2t.common.search import SEARCH_CONTROLS
from rlt2t.services.admission import ServiceTime, Work, sampled_work, total
from rlt2t.services.backends import (
    FILTER_NAMES,
    Generation,
    PolicyBackend,
    Sampling,
    Scored,
    StepControl,
    load_backend,
)
from rlt2t.services.batching import Batcher, Overloaded
from rlt2t.services.http import (
    BODY_REFUSED,
    OVERLOADED,
    UNAUTHORIZED,
    CheckThread,
    OpenApiResponses,
    ServiceMetrics,
    add_common_routes,
    auth_dependencies,
    disconnected,
    field_error,
    install_error_handlers,
    install_middleware,
    load_token,
)
from rlt2t.services.memory import release_memory
from rlt2t.services.reload import CheckpointWatcher, is_checkpoint_root
from rlt2t.services.schemas import (
    Candidate,
    CandidatesRequest,
    CandidatesResponse,
    ErrorResponse,
    ModelInfo,
    PairResult,
    PairsRequest,
    PairsResponse,
    ScoreRequest,
    ScoreResponse,
    TargetScore,
    reference_lists,
)

log = logging.getLogger("rlt2t.services.policy")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALIBRATION_WAIT_S = 300.0
"""Start-up waits this long at most for the calibration calls (a slow model serves uncalibrated meanwhile)."""
SAMPLING_REDUCE = ("fewer sources, num_candidates or max_new_tokens (or shorter sources); an operator may raise "
                   "serve.request_timeout_s")


# -- runners: executed on the batcher's worker thread, one merged call per batch ----------------------

# Items end with the source's token count (what measuring a call's work needs).

def _run_candidates(backend: PolicyBackend, key: tuple[str, Sampling], items: list[tuple[str, list[int], int]],
                    control: StepControl) -> list[list[Generation]]:
    sampling = key[1]
    return backend.candidates([s for s, _, _ in items], sampling, [seed for _, seeds, _ in items for seed in seeds],
                              control)


def _run_pair_samples(backend: PolicyBackend, key: tuple[str, Sampling], items: list[tuple[str, str, int, int]],
                      control: StepControl) -> list[list[Generation]]:
    # Row seeds as RolloutWorker keys them, with the version of the weights that actually sample.
    sampling = key[1]
    seeds = [stable_seed(seed, backend.version, ex_id, j) for _, ex_id, seed, _ in items
             for j in range(sampling.num_candidates)]
    return backend.candidates([s for s, _, _, _ in items], sampling, seeds, control)


def _run_score(backend: PolicyBackend, key: str, items: list[tuple[str, list[str], int]],
               control: StepControl) -> list[list[Scored]]:
    return backend.score([s for s, _, _ in items], [t for _, t, _ in items])


# -- work: what the service-time model predicts from and learns from (rlt2t.services.admission) -------------

def _sampled_work_done(items: list[tuple], results: list[list[Generation]]) -> Work:
    """What sampling these items did: each row's own length (rows that stopped early left the batch)."""
    done = []
    for item, gens in zip(items, results, strict=True):
        n = item[-1]
        lengths = [len(g.token_ids) for g in gens]
        done.append(Work(steps=max(lengths, default=0), rows=float(sum(lengths)),
                         context=float(sum(m * (n + m / 2) for m in lengths)), prefill=float(len(lengths) * n)))
    return total(done)


def _beam_work_done(beam_size: int):
    """What beam search did for items: every beam runs as long as the longest hypothesis of its source."""
    def measure(items: list[tuple], results: list[list[Generation]]) -> Work:
        return total(sampled_work(beam_size, item[-1], max((len(g.token_ids) for g in gens), default=0))
                     for item, gens in zip(items, results, strict=True))

    return measure


def _score_work(source_tokens: int, target_tokens: Sequence[int]) -> Work:
    """Teacher forcing: one forward pass over every target (+ EOS) after the source."""
    return total(Work(steps=1, rows=float(t + 1), context=float((t + 1) * (source_tokens + (t + 1) / 2)),
                      prefill=float(source_tokens)) for t in target_tokens)


def calibration_source(backend: PolicyBackend, tokens: int) -> tuple[str, int]:
    """A source of about ``tokens`` tokens (at most) that passes the backend's token rule, and its token count:
    a word repeated (``1`` for an ``ids`` vocabulary, a common word for a subword one)."""
    for word in ("1", "a", "the", "x"):
        text = " ".join([word] * tokens)
        if backend.check_text(text) is not None:
            continue
        (n,) = backend.count_tokens([text])
        if n > tokens:  # the word is several tokens here
            text = " ".join([word] * max(1, tokens * tokens // n))
            (n,) = backend.count_tokens([text])
        if 0 < n <= tokens:
            return text, n
    raise ValueError("no calibration source passes this tokenizer's token rule")


CALIBRATION_SHAPES = ((1, "short", 2), (1, "short", 4), (64, "short", 1), (4, "long", 4), (16, "long", 1),
                      (16, "short", 2), (64, "long", 1))
"""(rows, source, new tokens in units of 16) of the calibration calls: rows, steps, attended positions and source
positions varied apart from each other (few rows over long contexts, many over short ones), so that the fit can tell
them apart."""


def calibrate_policy(backend: PolicyBackend, max_source_tokens: int) -> list[tuple[Work, float]]:
    """Sampling calls of the :data:`CALIBRATION_SHAPES` at temperature 100 (no row stops early), each run twice,
    interleaved, its faster time kept (a burst of other work on the machine slows one run, rarely both): what the
    service-time model is fitted to at start-up. A few seconds on a CPU for the `small` preset, after one warm-up
    call."""
    limit = min(max_source_tokens, backend.max_positions - 1)
    unit = max(1, min(16, (backend.max_positions - 1) // 8))
    texts = {"short": calibration_source(backend, min(8, limit)), "long": calibration_source(backend, min(255, limit))}
    backend.candidates([texts["short"][0]], Sampling(num_candidates=1, top_k=0, temperature=100.0, max_new_tokens=2),
                       [0])  # warm-up: first-call allocations are not the model's speed
    best: dict[int, tuple[Work, float]] = {}
    for _ in range(2):
        for i, (rows, kind, steps) in enumerate(CALIBRATION_SHAPES):
            text, n = texts[kind]
            sampling = Sampling(mode="sample", num_candidates=rows, top_k=0, temperature=100.0, beam_size=1,
                                max_new_tokens=steps * unit)
            started = time.perf_counter()
            gens = backend.candidates([text], sampling, list(range(rows)))
            seconds = time.perf_counter() - started
            if i not in best or seconds < best[i][1]:
                best[i] = (_sampled_work_done([(text, n)], gens), seconds)
    return list(best.values())


class _PolicyMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__("rlt2t_policy")
        self.batch_sources = Histogram("rlt2t_policy_batch_sources", "Sources per model call", buckets=BATCH_BUCKETS,
                                       registry=self.registry)
        self.batch_seconds = Histogram("rlt2t_policy_batch_seconds", "Model call time",
                                       buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.queue_depth = Gauge("rlt2t_policy_queue_sources", "Sources waiting for a model call",
                                 registry=self.registry)
        self.queue_cost = Gauge("rlt2t_policy_queue_cost", "Work (token positions) waiting for a model call",
                                registry=self.registry)
        self.running_cost = Gauge("rlt2t_policy_running_cost", "Work (token positions) of the model call running now",
                                  registry=self.registry)
        self.model_version = Gauge("rlt2t_policy_model_version", "Policy version being served",
                                   registry=self.registry)
        self.reloads = Counter("rlt2t_policy_reloads", "Checkpoints hot-reloaded", registry=self.registry)

    def on_batch(self, sources: int, seconds: float) -> None:
        self.batch_sources.observe(sources)
        self.batch_seconds.observe(seconds)


def create_app(cfg: Config, *, checkpoint_dir: str | Path | None = None, backend: PolicyBackend | None = None,
               document_frequency: str | Path | None = None) -> FastAPI:
    """The policy server app.

    ``backend`` given: serve it (and watch ``checkpoint_dir`` only if that is given too). Otherwise
    load the newest complete checkpoint of ``checkpoint_dir`` (default ``cfg.serve.checkpoint_dir``; a
    plain model directory works too) and hot-reload newer ones every ``serve.reload_interval_s``.
    A checkpoint root with no complete checkpoint yet (it may not exist yet either, as long as its
    parent does: a training run about to write it) is waited for: model routes and /readyz answer 503
    with Retry-After until the first one is loaded. Raises FileNotFoundError when neither the root nor
    its parent exists (most likely a typo).
    """
    serve = cfg.serve
    df = DocumentFrequency.load(document_frequency) if document_frequency is not None else None

    def build_mbr_utility(name: str, key: str) -> PairUtility:
        """A vectorised MBR utility (configured as the eval tables configure it; CIDEr-D's document frequencies
        the server's ``document_frequency``, else the pool's); ValueError naming ``key`` for any other name or a
        metric that cannot be built."""
        if name not in VECTORISED_METRICS:
            raise ValueError(f"{key}={name!r}: the policy server computes only the vectorised MBR utilities "
                             f"({', '.join(VECTORISED_METRICS)}), whose work is bounded by the candidates' n-gram "
                             "counts; rerank with other metrics offline (rlt2t predict --rerank mbr)")
        params = metric_params(name, cfg.metric)
        if name in ("task_score", "cider_d"):
            params["df"] = df
        utility = metric_utility(name, key, **params)
        if isinstance(utility, MetricUtility):  # the name was registered anew over the built-in metric
            raise ValueError(f"{key}={name!r}: registered here as {type(utility.metric).__name__}, which is scored "
                             "one pair at a time: not a vectorised utility")
        return utility

    default_utility = build_mbr_utility(serve.mbr_utility, "serve.mbr_utility")  # before any model loads
    watch_root: Path | None = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if backend is None:
        root = watch_root or cfg.path(serve.checkpoint_dir)
        if not root.exists() and not root.parent.is_dir():
            sft = cfg.run_dir / "sft" / "checkpoints"
            hint = (f" (no RL run there yet: to serve the SFT model, --checkpoint-dir {sft})"
                    if checkpoint_dir is None and sft.is_dir() else "")
            raise FileNotFoundError(f"serve.checkpoint_dir: neither {root} nor its parent exists{hint}")
        if is_checkpoint_root(root) and latest_complete_checkpoint(root) is None:
            log.warning("no complete checkpoint under %s yet: answering 503 until one appears", root)
        else:
            # A root: its newest checkpoint, as the watch below follows the training run from there on.
            newest = latest_complete_checkpoint(root) if is_checkpoint_root(root) else None
            backend = load_backend(cfg, newest or resolve_model_dir(root))
        watch_root = root
    if watch_root is not None and not is_checkpoint_root(watch_root):
        watch_root = None  # a single model directory: nothing newer can appear in it
    token = load_token(serve)
    protected = auth_dependencies(token)
    auth_responses: OpenApiResponses = UNAUTHORIZED if token else {}

    metrics = _PolicyMetrics()
    batcher = Batcher(backend, max_batch_size=serve.max_batch_size, max_wait_ms=serve.max_wait_ms,
                      max_queue_cost=serve.max_queue_cost, max_call_cost=serve.max_call_cost, on_batch=metrics.on_batch,
                      timing=ServiceTime(), calibration=lambda b: calibrate_policy(b, serve.max_tokens_per_source),
                      release=release_memory, release_after_cost=max(1, serve.max_call_cost // 2),
                      request_timeout_s=serve.request_timeout_s)
    metrics.queue_depth.set_function(lambda: batcher.queue_depth)
    metrics.queue_cost.set_function(lambda: batcher.queued_cost)
    metrics.running_cost.set_function(lambda: batcher.running_cost)
    metrics.model_version.set_function(lambda: batcher.backend.version if batcher.backend is not None else -1)
    metrics.track_service_time(lambda: batcher.timing)

    def install(new: PolicyBackend) -> None:
        batcher.swap_backend(new)
        metrics.reloads.inc()

    watcher = None
    if watch_root is not None:
        watcher = CheckpointWatcher(watch_root, loader=lambda p: load_backend(cfg, p), install=install,
                                    interval_s=serve.reload_interval_s,
                                    current=backend.checkpoint if backend is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        if backend is not None:  # requests wait for the calibration: admission needs the model's speed
            await run_in_threadpool(batcher.wait_calibrated, CALIBRATION_WAIT_S)
        if watcher is not None:
            watcher.start()
        if backend is not None:
            log.info("serving %s (version %d, %s backend)", backend.checkpoint, backend.version, backend.name)
        try:
            yield
        finally:
            if watcher is not None:
                watcher.stop()
            batcher.stop()
            if not batcher.close_backends():
                log.warning("a batch was still running at shutdown: its backend was left open")

    app = FastAPI(title="rlt2t policy server", version="1", lifespan=lifespan)
    app.state.batcher, app.state.watcher, app.state.metrics = batcher, watcher, metrics
    install_error_handlers(app, metrics)
    install_middleware(app, metrics, serve, token)
    not_loaded_retry_s = max(1, math.ceil(serve.reload_interval_s))  # until the first checkpoint loads

    def ready() -> bool | str:
        if batcher.stopping:
            return "shutting down"
        return f"no complete checkpoint under {watch_root} yet" if batcher.backend is None else True

    add_common_routes(app, metrics, ready, protected, retry_after_s=not_loaded_retry_s)
    checks = CheckThread()

    # -- validation shared by the routes -------------------------------------------------------------

    def loaded() -> PolicyBackend:
        """The backend the next batch runs on; 503 (Retry-After) while no checkpoint has been loaded."""
        b = batcher.backend
        if b is None:
            raise Overloaded(f"no complete checkpoint under {watch_root} yet", not_loaded_retry_s)
        return b

    def token_limit() -> int:
        # EOS takes one position: a text of n tokens is n + 1 ids on the encoder or decoder side.
        return min(serve.max_tokens_per_source, loaded().max_positions - 1)

    def check_texts(field: str, texts: Sequence[str], listed: bool = True, at: tuple[int, ...] = ()) -> list[int]:
        """Each text under the token rule and the length limit; returns their token counts. Text by text, so
        that a request is refused at its first bad text without tokenizing the rest. Run it on the check
        thread (``checks.run``): it tokenizes. ``at``: the list's own index in ``field`` (a list of lists)."""
        backend, limit = loaded(), token_limit()
        counts = []
        for i, text in enumerate(texts):
            loc: tuple[str | int, ...] = ("body", field, *at, i) if listed else ("body", field, *at)
            if (problem := backend.check_text(text)) is not None:
                raise field_error(loc, problem, text)
            (n,) = backend.count_tokens([text])
            if n > limit:
                raise field_error(loc, f"{n} tokens; at most {limit} per text "
                                  "(serve.max_tokens_per_source and the model's positions)")
            counts.append(n)
        return counts

    def check_cost(costs: Sequence[int], product: str) -> list[int]:
        """The per-item work estimates of a request, refused (422) when their sum is over the bound."""
        total = sum(costs)
        if total > serve.max_request_cost:
            raise field_error(("body",), f"work {product} = {total} token positions; at most "
                              f"{serve.max_request_cost} per request (serve.max_request_cost)")
        return list(costs)

    def sampling_product(counts: Sequence[int], rows: int, max_new: int, what: str) -> str:
        mean = sum(counts) / max(1, len(counts))
        return f"{len(counts)} sources x {rows} {what} x ({mean:.0f} source tokens on average + {max_new} new tokens)"

    def sampling_costs(counts: Sequence[int], rows: int, max_new: int, what: str) -> list[int]:
        return check_cost([rows * (n + max_new) for n in counts], sampling_product(counts, rows, max_new, what))

    async def submit(request: Request, key, items: list, runner, costs: list[int], work: list[Work], measure=None,
                     describe: str = "", reduce: str = SAMPLING_REDUCE):
        # The deadline counts from the request's arrival at the gate (body reading and validation included).
        return await batcher.submit(key, items, runner, costs=costs, work=work, measure=measure,
                                    gone=disconnected(request), describe=describe, reduce=reduce,
                                    deadline=request.state.arrived + serve.request_timeout_s)

    def check_count(field: str, value: int, limit: int, what: str, by: str) -> None:
        """A count over its limit is a 422 naming the field and what sets the limit (``by``: the config key, or
        the rule)."""
        if value > limit:
            raise field_error(("body", field), f"{value} {what}; at most {limit} ({by})", value)

    def check_filters(sampling: Sampling) -> None:
        """A sampling filter the loaded backend lacks (top-p, epsilon) is a 422 on its field."""
        backend = loaded()
        have = getattr(backend, "sampling_filters", FILTER_NAMES.keys())
        for field in sampling.filters():
            if field not in have:
                name, off = FILTER_NAMES[field]
                raise field_error(("body", field), f"the {backend.name} backend has no {name} sampling; leave {field} "
                                  f"at {off:g}", getattr(sampling, field))

    def mbr_utility(name: str | None) -> PairUtility:
        """The MBR utility a request names (None: serve.mbr_utility, built at startup); 422 on ``utility``."""
        if name is None:
            return default_utility
        try:
            return build_mbr_utility(name, "utility")
        except ValueError as e:
            raise field_error(("body", "utility"), str(e), name) from None

    # rerank: reward. Each reward is built on its first use and kept (a reward model loads once); a reward that reads
    # references is remembered as refused, a load failure is not (the next request tries again).
    rerank_rewards: dict[str | None, WeightedReward | str] = {}
    building_reward = threading.Lock()
    scoring_reward = threading.Lock()  # one request at a time: a user's function need not be thread-safe

    def reward_key(name: str | None) -> str:
        return "reward.terms" if name is None else f"reward.named.{name}"

    def rerank_reward(name: str | None) -> WeightedReward:
        """The reward a ``rerank: reward`` request names (None: reward.terms), reference-free; 422 on ``reward`` when
        it is not configured, cannot be loaded here, or reads references. Blocks while it loads: run it off the
        event loop."""
        if name is not None and name not in cfg.reward.named:
            known = ", ".join(sorted(cfg.reward.named)) or "none"
            raise field_error(("body", "reward"), f"reward={name!r}: not a reward of this server's reward.named "
                              f"(configured: {known}); null for its reward.terms", name)
        key = reward_key(name)
        with building_reward:
            if name not in rerank_rewards:
                try:
                    built = build_reward(cfg.reward, device=cfg.reward.device, where=key,
                                         terms=None if name is None else cfg.reward.named[name])
                except Exception as e:  # a path that does not import or load: the server's config, said plainly
                    raise field_error(("body", "reward"), f"{key} cannot be loaded on this server "
                                      f"({type(e).__name__}: {e})", name) from None
                try:
                    rerank_rewards[name] = check_reference_free(built, key)
                except ValueError as e:
                    rerank_rewards[name] = str(e)
            found = rerank_rewards[name]
        if isinstance(found, str):
            raise field_error(("body", "reward"), found, name)
        return found

    def rerank_by_reward(reward: WeightedReward, name: str | None, sources: Sequence[str],
                         pools: Sequence[Sequence[Candidate]]) -> tuple[list[int], list[list[float]]]:
        """Per source: the candidate of highest reward (ties: the higher mean log-prob, then the lower index; the
        first entry of its text) and every candidate's reward. Each distinct text is scored once, in one call."""
        firsts: list[dict[str, int]] = []  # per source: each distinct text -> its first entry
        for cands in pools:
            firsts.append({})
            for k, c in enumerate(cands):
                firsts[-1].setdefault(c.text, k)
        texts = [list(first) for first in firsts]
        with scoring_reward:
            try:
                values = reward.score([s for s, ts in zip(sources, texts, strict=True) for _ in ts],
                                      [t for ts in texts for t in ts])
            except RewardError as e:
                raise field_error(("body", "reward"), f"{reward_key(name)}: {e}", name) from None
        if not all(math.isfinite(v) for v in values):  # a Python term checks its own; a model's NaN is caught here
            raise field_error(("body", "reward"), f"{reward_key(name)} returned a score that is not finite for this "
                              "request's candidates", name)
        chosen, scores, at = [], [], 0
        for cands, first in zip(pools, firsts, strict=True):
            of = {t: float(v) for t, v in zip(first, values[at : at + len(first)], strict=True)}
            at += len(first)
            mean = {t: cands[k].total_logprob / max(1, len(cands[k].logprobs)) for t, k in first.items()}
            best = max(first, key=lambda t: (of[t], mean[t]))  # max keeps the first of equal keys: the lower index
            chosen.append(first[best])
            scores.append([of[c.text] for c in cands])
        return chosen, scores

    def check_new_tokens(value: int) -> None:
        # The decoder start token takes the first position; the last token decoded is never fed back.
        limit = loaded().max_positions
        if value > limit:
            raise field_error(("body", "max_new_tokens"), f"at most {limit} for this model (its positions)", value)

    # -- routes --------------------------------------------------------------------------------------

    # The rerank fields answer only a request that asks for them (CandidatesResponse leaves them out otherwise).
    @app.post("/v1/candidates", response_model=CandidatesResponse, dependencies=protected, tags=["policy"],
              responses={**auth_responses, **OVERLOADED, **BODY_REFUSED})
    async def candidates(req: CandidatesRequest, request: Request) -> CandidatesResponse:
        """Sample or beam-search candidates for each source."""
        check_count("sources", len(req.sources), serve.max_sources_per_call, "sources", "serve.max_sources_per_call")
        check_count("num_candidates", req.num_candidates, serve.max_candidates_per_source, "candidates per source",
                    "serve.max_candidates_per_source")
        if req.mode == "beam":
            check_count("beam_size", req.beam_size, serve.max_candidates_per_source, "beams",
                        "serve.max_candidates_per_source")
            check_count("num_candidates", req.num_candidates, req.beam_size, "hypotheses asked of a beam search",
                        "a beam search returns at most beam_size")
        check_new_tokens(req.max_new_tokens)
        if req.mode == "beam" and req.beam_size == 1 and req.length_penalty != SEARCH_CONTROLS["length_penalty"]:
            raise field_error(("body", "length_penalty"), "would do nothing: it ranks finished beam hypotheses by "
                              "length and beam_size 1 searches with one; set beam_size above 1 or leave "
                              f"length_penalty at {SEARCH_CONTROLS['length_penalty']:g}", req.length_penalty)
        if req.min_new_tokens >= req.max_new_tokens:
            raise field_error(("body", "min_new_tokens"), f"below max_new_tokens ({req.max_new_tokens}), which counts "
                              "the EOS", req.min_new_tokens)
        counts = await checks.run(check_texts, "sources", req.sources)
        rows, what = (req.beam_size, "beams") if req.mode == "beam" else (req.num_candidates, "candidates")
        costs = sampling_costs(counts, rows, req.max_new_tokens, what)
        # Only the settings a mode uses go into the batching key, so e.g. beam requests that differ in an
        # (unused) temperature still share a model call.
        beam_controls = {k: getattr(req, k) for k in SEARCH_CONTROLS}
        if req.mode == "beam":
            sampling = Sampling(mode="beam", num_candidates=req.num_candidates, beam_size=req.beam_size,
                                max_new_tokens=req.max_new_tokens, **beam_controls)
        else:
            if controls := Sampling(**beam_controls).beam_controls():
                field = controls[0]
                raise field_error(("body", field), f"{field} applies to mode: beam (samples are drawn from the "
                                  f"model's distribution); leave it at {SEARCH_CONTROLS[field]:g}",
                                  getattr(req, field))
            sampling = Sampling(mode="sample", num_candidates=req.num_candidates, top_k=req.top_k, top_p=req.top_p,
                                temperature=req.temperature, beam_size=1, max_new_tokens=req.max_new_tokens,
                                epsilon=req.epsilon)
            check_filters(sampling)
        base = req.seed if req.seed is not None else secrets.randbits(63)
        items = [(s, [stable_seed(base, i, j) for j in range(req.num_candidates)], n)
                 for i, (s, n) in enumerate(zip(req.sources, counts, strict=True))]
        if req.utility is not None and req.rerank != "mbr":
            raise field_error(("body", "utility"), f"utility is read only with rerank: mbr (rerank: {req.rerank})",
                              req.utility)
        if req.mbr_weights != "uniform" and req.rerank != "mbr":  # (the default, which clients send, says nothing)
            raise field_error(("body", "mbr_weights"), f"mbr_weights is read only with rerank: mbr (rerank: "
                              f"{req.rerank})", req.mbr_weights)
        if req.reward is not None and req.rerank != "reward":
            raise field_error(("body", "reward"), f"reward is read only with rerank: reward (rerank: {req.rerank})",
                              req.reward)
        # Before decoding: a bad utility or reward is a 422 at once.
        utility = mbr_utility(req.utility) if req.rerank == "mbr" else None
        reward = await run_in_threadpool(rerank_reward, req.reward) if req.rerank == "reward" else None
        results, used = await submit(request, ("candidates", sampling), items, _run_candidates, costs,
                                     [sampled_work(rows, n, req.max_new_tokens) for n in counts],
                                     _beam_work_done(req.beam_size) if req.mode == "beam" else _sampled_work_done,
                                     sampling_product(counts, rows, req.max_new_tokens, what))
        response = CandidatesResponse(
            candidates=[[Candidate(text=g.text, token_ids=g.token_ids, logprobs=g.logprobs,
                                   total_logprob=float(sum(g.logprobs)), sample_logprobs=g.sample_logprobs,
                                   forced_eos=g.forced_eos) for g in gens] for gens in results],
            policy_version=used.version,
        )
        if utility is not None:
            def rerank() -> None:
                started = time.perf_counter()
                weighted = req.mbr_weights == "probability"
                picks = [mbr_over_entries([c.text for c in cands], utility,
                                          [c.total_logprob for c in cands] if weighted else None, source)
                         for source, cands in zip(req.sources, response.candidates, strict=True)]
                response.chosen = [k for k, _ in picks]
                response.expected_utility = [e.tolist() for _, e in picks]
                response.rerank_seconds = time.perf_counter() - started

            await run_in_threadpool(rerank)  # metric work stays off the event loop
        if reward is not None:
            started = time.perf_counter()
            response.chosen, response.reward_scores = await run_in_threadpool(
                rerank_by_reward, reward, req.reward, req.sources, response.candidates)
            response.rerank_seconds = time.perf_counter() - started
        return response

    @app.post("/v1/pairs", response_model=PairsResponse, dependencies=protected, tags=["policy"],
              responses={**auth_responses, **OVERLOADED, **BODY_REFUSED})
    async def pairs(req: PairsRequest, request: Request) -> PairsResponse:
        """Scored (better, worse) pairs for rank training, one per source."""
        r = cfg.rollout
        n = len(req.sources)
        check_count("sources", n, serve.max_sources_per_call, "sources", "serve.max_sources_per_call")
        if len(req.references) != n:
            raise field_error(("body", "references"), f"{len(req.references)} references for {n} sources")
        if req.example_ids is not None and len(req.example_ids) != n:
            raise field_error(("body", "example_ids"), f"{len(req.example_ids)} example ids for {n} sources")
        num_samples = req.num_samples if req.num_samples is not None else r.num_samples
        check_count("num_samples", num_samples, serve.max_candidates_per_source, "samples per source",
                    "serve.max_candidates_per_source")
        max_new = req.max_new_tokens if req.max_new_tokens is not None else r.max_new_tokens
        check_new_tokens(max_new)
        counts = await checks.run(check_texts, "sources", req.sources)
        refs = reference_lists(req.references)

        def check_references() -> None:
            for i, given in enumerate(req.references):
                check_texts("references", [given] if isinstance(given, str) else given, isinstance(given, list), (i,))

        await checks.run(check_references)
        costs = sampling_costs(counts, num_samples, max_new, "samples")
        sampling = Sampling(mode="sample", num_candidates=num_samples,
                            top_k=req.top_k if req.top_k is not None else r.top_k, top_p=req.top_p,
                            temperature=req.temperature if req.temperature is not None else r.temperature,
                            beam_size=1, max_new_tokens=max_new)
        check_filters(sampling)
        ids = list(req.example_ids) if req.example_ids is not None else [str(i) for i in range(n)]
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        include_gold = req.include_gold if req.include_gold is not None else r.include_gold
        results, used = await submit(request, ("pairs", sampling),
                                     list(zip(req.sources, ids, [seed] * n, counts, strict=True)), _run_pair_samples,
                                     costs, [sampled_work(num_samples, c, max_new) for c in counts], _sampled_work_done,
                                     sampling_product(counts, num_samples, max_new, "samples"))

        def score() -> list:
            sets = [candidate_set(ex_id, src, rs[0], [g.text for g in gens], include_gold=include_gold, seed=seed,
                                  version=used.version, references=tuple(rs) if len(rs) > 1 else ())
                    for ex_id, src, rs, gens in zip(ids, req.sources, refs, results, strict=True)]
            table = df if df is not None else DocumentFrequency.from_references(refs)
            return score_pairs(task_reward(cfg.reward, table), sets)

        scored = await run_in_threadpool(score)  # metric work stays off the event loop
        return PairsResponse(pairs=[PairResult(**vars(p)) for p in scored], policy_version=used.version)

    @app.post("/v1/score", response_model=ScoreResponse, dependencies=protected, tags=["policy"],
              responses={**auth_responses, **OVERLOADED, **BODY_REFUSED})
    async def score(req: ScoreRequest, request: Request) -> ScoreResponse:
        """Teacher-forced log-probs of each target given the source."""
        check_count("targets", len(req.targets), serve.max_candidates_per_source, "targets",
                    "serve.max_candidates_per_source")

        def check_source_and_targets() -> tuple[int, list[int]]:  # one trip to the check thread
            return check_texts("source", [req.source], False)[0], check_texts("targets", req.targets)

        n_source, counts = await checks.run(check_source_and_targets)
        product = (f"{len(counts)} targets x ({n_source} source tokens + {sum(counts) / len(counts):.0f} target tokens "
                   "on average + 1)")
        cost = check_cost([sum(n_source + n + 1 for n in counts)], product)
        results, used = await submit(request, "score", [(req.source, list(req.targets), n_source)], _run_score, cost,
                                     [_score_work(n_source, counts)], describe=product,
                                     reduce="fewer or shorter targets; an operator may raise serve.request_timeout_s")
        return ScoreResponse(
            scores=[TargetScore(token_ids=s.token_ids, logprobs=s.logprobs, total_logprob=float(sum(s.logprobs)),
                                mean_logprob=float(sum(s.logprobs)) / max(1, len(s.logprobs)))
                    for s in results[0]],
            policy_version=used.version,
        )

    @app.get("/v1/model", response_model=ModelInfo, dependencies=protected, tags=["policy"],
             responses={**auth_responses, **OVERLOADED})
    async def model_info() -> ModelInfo:
        """The weights being served (and, when they are not the newest on disk, why)."""
        b = loaded()
        return ModelInfo(version=b.version, checkpoint=b.checkpoint, checksum=b.checksum, loaded_at=b.loaded_at,
                         backend=b.name, max_source_tokens=token_limit(),
                         on_disk=watcher.on_disk if watcher is not None else True,
                         note=watcher.note if watcher is not None else None)

    @app.post("/v1/reload", response_model=ModelInfo, dependencies=protected, tags=["policy"],
              responses={**auth_responses, **BODY_REFUSED,
                         409: {"model": ErrorResponse, "description": "Nothing to reload"}})
    async def reload() -> ModelInfo:
        """Serve the newest complete checkpoint of the watched directory, even one older than the checkpoint
        being served (hot reload never goes back on its own): an operator's action after the served one
        was deleted. 200 with what is served (also when that is already the newest); 409 when there is nothing
        to load (the watched directory holds no complete checkpoint, or only the deleted one was served)."""
        if watcher is None:
            raise HTTPException(409, "serving a single model directory: there is nothing to reload")
        try:
            installed = await run_in_threadpool(watcher.load_newest)
        except Exception as e:
            raise HTTPException(409, f"could not load the newest checkpoint: {type(e).__name__}: {e}") from e
        if not installed and (batcher.backend is None or not watcher.on_disk):
            kept = "" if batcher.backend is None else (f"; still serving {loaded().checkpoint} from memory, "
                                                       "deleted from disk")
            raise HTTPException(409, f"no complete checkpoint under {watch_root}{kept}")
        return await model_info()

    return app
