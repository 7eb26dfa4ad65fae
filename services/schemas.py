"""The HTTP API contract of the policy and reward servers: request and response models.

Both the FastAPI apps and the typed client (``rlt2t.services.client``) use these models, so a field
renamed here changes both sides at once. Every request model forbids unknown fields and non-finite
numbers and is strict: no string is read as a number or a boolean (``"3"`` is not 3, ``true`` is not 1),
and every string must be Unicode text (pydantic refuses lone surrogates). A typo, a NaN or a wrong type is a 422
naming the field, never a 5xx.

Static bounds (``TEXT_MAX_CHARS``, ``LIST_MAX_ITEMS``, ...) only keep a hostile request cheap to
reject; the configured limits (``serve.max_sources_per_call``, ``serve.max_tokens_per_source``,
``serve.max_candidates_per_source``) are checked by the apps after parsing and answered with the same
422 body FastAPI gives for schema errors (``{"detail": [{"loc": [...], "msg": ..., "type": ...}]}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StringConstraints, model_serializer

TEXT_MAX_CHARS = 100_000
"""Hard cap on the characters of any one text (sources, targets, references, candidates)."""
LIST_MAX_ITEMS = 4096
"""Hard cap on the length of any list in a request."""
SEED_MAX = 2**63 - 1
"""Seeds are 63-bit (what torch generators accept everywhere)."""
MIN_TEMPERATURE = 1e-3
"""Smallest sampling temperature: far smaller ones (under about 1e-38) overflow the logits divided by it to
infinities (a refused temperature is a 422; for greedy decoding ask for top_k=1)."""

# A source must hold some text: an all-whitespace source tokenises to nothing but EOS.
SourceText = Annotated[str, StringConstraints(min_length=1, max_length=TEXT_MAX_CHARS, pattern=r"\S")]
# Targets, candidates and references may be empty strings (a policy can emit EOS at once).
Text = Annotated[str, StringConstraints(max_length=TEXT_MAX_CHARS)]
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, use_attribute_docstrings=True)


class _Response(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class ErrorResponse(_Response):
    """Body of 401 / 503 answers (and any other error that is not a field validation error)."""

    detail: str
    """What went wrong."""


class TooSlowResponse(ErrorResponse):
    """Body of a 429: the request alone is predicted to take longer than the server may work on it."""

    predicted_s: float
    """Seconds the request is predicted to take at the server's measured speed (the model's time with a margin
    for its error, divided by the share of the server it can expect next to the small requests running)."""
    limit_s: float
    """Seconds it had left of serve.request_timeout_s when it was refused."""


class SamplingParams(_Request):
    """How candidates are produced; shared by /v1/candidates (and, with server defaults, /v1/pairs)."""

    mode: Literal["sample", "beam"] = "sample"
    """`sample`: ancestral sampling with top-k / top-p / epsilon / temperature; `beam`: beam search."""
    num_candidates: int = Field(1, ge=1, le=LIST_MAX_ITEMS)
    """Samples per source (`sample`) or hypotheses kept per source (`beam`, at most beam_size)."""
    top_k: int = Field(0, ge=0, le=1_000_000)
    """Sample among the k most likely tokens (0: no top-k filter; 1: greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: no filter)."""
    epsilon: float = Field(0.0, ge=0.0, lt=1.0)
    """Epsilon sampling: tokens whose probability is under epsilon are not drawn (the most likely one always can be;
    0: no filter; 0.02 is a common choice for a minimum-Bayes-risk pool). The torch backend only."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=100.0)
    """Logits are divided by this before sampling (log-probs returned are of the raw model)."""
    beam_size: int = Field(4, ge=1, le=LIST_MAX_ITEMS)
    """Beam width of `beam` mode."""
    max_new_tokens: int = Field(64, ge=1, le=100_000)
    """Longest candidate in tokens, EOS included (also bounded by the model's positions)."""
    no_repeat_ngram_size: int = Field(0, ge=0, le=1024)
    """`beam` mode: no n-gram of this many tokens occurs twice in a hypothesis (0: no limit). With `sample`, a 422:
    samples are drawn from the model's distribution."""
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0)
    """`beam` mode: a token the hypothesis already holds has its score divided by this when positive, multiplied
    when negative (1: none). With `sample`, a 422."""
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    """`beam` mode: a finished hypothesis ranks by its log-probability divided by its length to this power (1: the
    mean per token; 0: the sum, which favours short ones; 2: what BART's summarisation checkpoints ship with). With
    `sample`, or with a `beam_size` of 1 (one hypothesis, nothing to rank), a 422."""
    min_new_tokens: int = Field(0, ge=0, le=100_000)
    """`beam` mode: no EOS before this many tokens (0: none; below `max_new_tokens`). With `sample`, a 422."""
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    """`sample` mode: same seed, weights and request → same candidates, whatever else is batched with
    it (None: fresh randomness)."""


class CandidatesRequest(SamplingParams):
    """POST /v1/candidates."""

    sources: list[SourceText] = Field(min_length=1, max_length=LIST_MAX_ITEMS)
    """Source texts, under the tokenizer's token rule (an ``ids`` vocabulary: data tokens and <sep> only)."""
    rerank: Literal["none", "mbr", "reward"] = "none"
    """`mbr`: also pick one candidate per source by minimum Bayes risk, the highest expected `utility` over the
    source's candidates (docs/design.md, "Minimum-Bayes-risk decoding"); `chosen` and `expected_utility` answer.
    `reward`: also pick the candidate the server's `reward` scores highest, without references (ties: the higher
    mean log-prob, then the lower index); `chosen` and `reward_scores` answer."""
    utility: Name | None = None
    """`rerank: mbr` only (a 422 otherwise). MBR utility: `task_score`, `bleu4`, `sacrebleu` or `cider_d` (None:
    serve.mbr_utility). The server takes only these vectorised utilities, computed for all pairs at once from n-gram
    counts, so a request's MBR work is bounded by its candidates (at most serve.max_candidates_per_source per source,
    max_new_tokens each); other metrics: `rlt2t predict --rerank mbr`. CIDEr-D's document frequencies: the server's,
    else the pool's distinct texts."""
    mbr_weights: Literal["uniform", "probability"] = "uniform"
    """MBR: `uniform`: each candidate against the source's other candidates, duplicates as separate entries
    (leave-one-out); `probability`: against every distinct candidate, itself included, weighted by its normalised
    sequence probability (exp of the total_logprob). `probability` without `rerank: mbr` is a 422."""
    reward: Name | None = None
    """`rerank: reward` only (a 422 otherwise): a name of the server's `reward.named` (None: its `reward.terms`). Every
    term must score without references (python, reward_model, classifier; a metric is refused, 422 naming the term);
    the reward loads on its first use and is kept (a load failure is a 422 on `reward` saying why; the next request
    tries again)."""


class Candidate(_Response):
    text: str
    """Decoded text (special tokens dropped, whitespace normalised)."""
    token_ids: list[int]
    """The generated token ids, without the decoder start token, EOS included when produced."""
    logprobs: list[float]
    """Per-token log-probability of ``token_ids`` under the raw model (log-softmax of the logits, not
    temperature- or top-k/top-p-adjusted): what reranking and the rank loss use."""
    total_logprob: float
    """Sum of ``logprobs``."""
    sample_logprobs: list[float]
    """Per-token log-probability under the distribution each token was drawn from (temperature, top-k,
    top-p): what a policy-gradient ratio compares with the learner's. Beam search: equal to ``logprobs``."""
    forced_eos: bool = False
    """The last token is the EOS forced at ``max_new_tokens`` (not drawn; its sample log-prob is 0)."""


class CandidatesResponse(_Response):
    candidates: list[list[Candidate]]
    """One list per source, in request order (``num_candidates`` each)."""
    policy_version: int
    """Version of the weights that produced every candidate of this response."""
    chosen: list[int] | None = None
    """`rerank: mbr` or `reward`: per source, the index of the chosen candidate (the first of its text)."""
    expected_utility: list[list[float]] | None = None
    """`rerank: mbr`: per source, each candidate's expected utility (a duplicate scores as its text)."""
    reward_scores: list[list[float]] | None = None
    """`rerank: reward`: per source, each candidate's reward (a duplicate scores as its text)."""
    rerank_seconds: float | None = None
    """`rerank: mbr` or `reward`: wall time of the rerank step for the whole request."""

    @model_serializer(mode="wrap")
    def _without_unset_rerank_fields(self, handler: SerializerFunctionWrapHandler):
        """The rerank fields answer only a request that asks for them: left out, not null, otherwise (other fields
        keep their nulls)."""
        out = handler(self)
        if isinstance(out, dict):
            for name in RERANK_RESPONSE_FIELDS:
                if getattr(self, name) is None:
                    out.pop(name, None)
        return out


RERANK_RESPONSE_FIELDS = ("chosen", "expected_utility", "reward_scores", "rerank_seconds")


def reference_lists(given: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """A request's ``references`` (per item one text, or a list of texts) as one list of texts per item."""
    return [[r] if isinstance(r, str) else list(r) for r in given]


class PairsRequest(_Request):
    """POST /v1/pairs: sample, build candidate sets and score the drawn pair, as rank training does.

    Fields left null take the server's ``rollout`` config (num_samples, top_k, temperature,
    max_new_tokens, include_gold).
    """

    sources: list[SourceText] = Field(min_length=1, max_length=LIST_MAX_ITEMS)
    """Source texts."""
    references: list[Text | Annotated[list[Text], Field(min_length=1, max_length=64)]] = Field(
        min_length=1, max_length=LIST_MAX_ITEMS)
    """Per source (same length as sources): its gold target, or a list of its references, the first the gold
    (added to the candidates with include_gold); every reference scores the pair, as rank training does with a
    row's "references"."""
    example_ids: list[Name] | None = Field(None, max_length=LIST_MAX_ITEMS)
    """Example ids keying the sampling randomness (default: "0", "1", ... by position)."""
    num_samples: int | None = Field(None, ge=1, le=LIST_MAX_ITEMS)
    """K samples per source before the gold is added."""
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    """Top-k filter of sampling (0: none)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus filter of sampling (1: none, as training)."""
    temperature: float | None = Field(None, ge=MIN_TEMPERATURE, le=100.0)
    """Sampling temperature."""
    max_new_tokens: int | None = Field(None, ge=1, le=100_000)
    """Longest sample in tokens, EOS included."""
    include_gold: bool | None = None
    """Add the reference to the candidates before the pair is drawn."""
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    """Run seed: with the same weights, version and ids the pairs equal the Ray rollout worker's
    (None: fresh randomness)."""


class PairResult(_Response):
    """The fields of ``rlt2t.common.types.ScoredPair``: ``a`` is the better candidate."""

    example_id: str
    source: str
    reference: str
    a: str
    b: str
    score_a: float
    score_b: float
    use_rank: bool
    policy_version: int


class PairsResponse(_Response):
    pairs: list[PairResult]
    """One pair per source, in request order."""
    policy_version: int
    """Version of the weights that sampled every pair."""


class ScoreRequest(_Request):
    """POST /v1/score: teacher-forced log-probs of candidate targets given one source."""

    source: SourceText
    """Source text."""
    targets: list[Text] = Field(min_length=1, max_length=LIST_MAX_ITEMS)
    """Candidate target texts (EOS is appended to each, as in training labels)."""


class TargetScore(_Response):
    token_ids: list[int]
    """Label ids of the target: its tokens then EOS."""
    logprobs: list[float]
    """log p(token_t | source, tokens_<t) under the raw model, one per label id."""
    total_logprob: float
    """Sum of ``logprobs``."""
    mean_logprob: float
    """``total_logprob / len(token_ids)`` (the rerank score)."""


class ScoreResponse(_Response):
    scores: list[TargetScore]
    """One entry per target, in request order."""
    policy_version: int
    """Version of the weights that scored them."""


class ModelInfo(_Response):
    """GET /v1/model."""

    version: int
    """`policy_version` of the checkpoint marker, else its step (0 for a plain model directory)."""
    checkpoint: str
    """Directory the weights were loaded from."""
    checksum: str
    """sha256 of the weight files."""
    loaded_at: float
    """Unix time the weights were loaded."""
    backend: str
    """Inference backend (`torch`, ...)."""
    max_source_tokens: int
    """Effective tokens-per-source limit (config limit and model positions)."""
    on_disk: bool = True
    """False once the served checkpoint has been deleted: the server keeps serving the weights it loaded."""
    note: str | None = None
    """Why the server is not serving the newest checkpoint on disk, when it is not (e.g. the served one was
    deleted and only older ones remain: serving one of those is POST /v1/reload or a restart)."""


class Health(_Response):
    status: str
    """`ok` (healthz) or `ready` (readyz)."""


class RewardRequest(_Request):
    """POST /v1/reward: per-sample scores of candidates against references."""

    candidates: list[Text] = Field(min_length=1, max_length=LIST_MAX_ITEMS)
    """Hypothesis texts."""
    references: list[Text | Annotated[list[Text], Field(min_length=1, max_length=64)]] | None = Field(
        None, min_length=1, max_length=LIST_MAX_ITEMS)
    """Per candidate: one reference string, or a list of references (required by reference metrics)."""
    sources: list[Text] | None = Field(None, min_length=1, max_length=LIST_MAX_ITEMS)
    """Per candidate: its source (required by the server's named rewards, which score (source, candidate))."""
    metrics: list[Annotated[Name, StringConstraints(max_length=64)]] = Field(
        default_factory=lambda: ["task_score"], min_length=1, max_length=32)
    """Registered metric names (task_score uses the server's reward.bleu_weight / cider_sigma), or names of
    the server's learned rewards (reward.named)."""


class RewardResponse(_Response):
    scores: dict[str, list[float]]
    """Metric or reward name → one score per candidate, in request order."""
    reward_model_versions: dict[str, dict[str, int]] = Field(default_factory=dict)
    """Named reward with reward-model terms → term (``reward_model``, ``reward_model#2``, ...) → version (training
    step) of the reward model that scored every candidate of this response."""


class RewardMetrics(_Response):
    """GET /v1/metrics (reward server): what a POST /v1/reward request's ``metrics`` may name."""

    metrics: list[str]
    """Registered metrics this server scores, sorted."""
    named: list[str]
    """Its learned rewards (``reward.named``), in config order."""
    unavailable: dict[str, str]
    """Registered metric or named reward this server does not offer → why: data or a package missing on this machine
    (with the command that installs it; checked at start-up), or constructor parameters a request cannot give."""
