"""The servers, export, predict and the annotation app: `serve`, `export`, `predict`, `annotate`."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from rlt2t.common.config.base import Quantization, _Section

PredictRerank = Literal["mean_logprob", "idf", "consensus", "reward", "mbr"]
"""The rerank modes (rlt2t.common.rerank.PREDICT_RERANK_MODES, the list the CLI offers; a test checks they agree)."""


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    """Bind address; loopback by default (set 0.0.0.0 deliberately, with a token)."""
    port: int = Field(8000, ge=0, le=65535)
    """Policy server port (0: any free port)."""
    reward_port: int = Field(8001, ge=0, le=65535)
    """Reward server port."""
    checkpoint_dir: str = "{run}/rl/checkpoints"
    """Checkpoint root (or model directory) the policy server serves; it hot-reloads the newest complete one."""
    backend: Literal["torch", "ct2"] = "torch"
    """Inference backend of the policy server."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the torch backend."""
    reload_interval_s: float = Field(2.0, gt=0.0)
    """How often the checkpoint root is polled for a newer complete checkpoint."""
    max_batch_size: int = Field(32, ge=1)
    """Sources batched into one model call across concurrent requests."""
    max_wait_ms: float = Field(5.0, ge=0.0)
    """How long the first request of a batch waits for others to join (and waiting work for a running call)."""
    max_sources_per_call: int = Field(64, ge=1)
    """Most sources in one request."""
    max_tokens_per_source: int = Field(512, ge=1)
    """Most tokens in one source (or reference/candidate) text."""
    max_candidates_per_source: int = Field(32, ge=1)
    """Most candidates (samples, beams, hypotheses or scored targets) per source."""
    mbr_utility: str = "task_score"
    """Default utility of /v1/candidates' `rerank: mbr` (a request may name another): `task_score`, `bleu4`,
    `sacrebleu` or `cider_d`, the vectorised utilities whose work the candidate limits bound (checked when the
    server starts)."""
    max_request_cost: int = Field(131_072, ge=1)
    """Most work one policy request may ask for, in token positions: rows x (source + new tokens) (422 beyond)."""
    max_queue_cost: int = Field(524_288, ge=1)
    """Queued policy work (token positions) beyond which requests are refused with 503 + Retry-After."""
    max_call_cost: int = Field(32_768, ge=1)
    """Most work in one model call; larger requests run as several calls, other requests' calls between them."""
    max_reward_cost: int = Field(16_777_216, ge=1)
    """Most work one /v1/reward request may ask for: per reference, token pairs + characters; x metrics."""
    max_reward_queue_cost: int = Field(67_108_864, ge=1)
    """Queued reward work (as max_reward_cost) beyond which requests are refused with 503 + Retry-After."""
    max_reward_call_cost: int = Field(2_097_152, ge=1)
    """Most reward work scored in one go; larger requests run in parts, other requests' parts between them."""
    request_timeout_s: float = Field(120.0, gt=0.0)
    """A request not answered this long after it arrived is dropped (503 + Retry-After), queued or running."""
    header_timeout_s: float = Field(10.0, gt=0.0)
    """A connection must send a complete request head within this many seconds (else it is closed)."""
    body_timeout_s: float = Field(30.0, gt=0.0)
    """A request body must arrive in full within this many seconds of its head (408 and close beyond)."""
    keepalive_timeout_s: float = Field(5.0, gt=0.0)
    """Idle keep-alive connections are closed after this many seconds."""
    token_env: str = "RLT2T_API_TOKEN"
    """Environment variable holding the bearer token (unset: no auth)."""
    token_file: str | None = None
    """File holding the bearer token (takes precedence over token_env)."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 beyond it, before any parsing or authentication)."""
    allow_unauthenticated: bool = False
    """Allow binding a non-loopback address without a bearer token (refused otherwise)."""
    num_cpus: float = Field(1.0, gt=0.0)
    """CPUs of the policy server when deployed as a Ray actor (`make deploy`)."""
    num_gpus: float = Field(0.0, ge=0.0)
    """GPU (fraction) of the policy server when deployed as a Ray actor."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray resources of the deployed policy server."""


class ExportConfig(_Section):
    quantization: Quantization = "int8"
    """CTranslate2 weight quantization."""
    out: str = "{run}/export"
    """Where `rlt2t export` writes (one subdirectory per exported model)."""
    threads: int = Field(0, ge=0)
    """CTranslate2 intra-op threads (0: its default)."""


class SearchControls(_Section):
    """Search's repetition and length controls (rlt2t.common.search), of `predict` (its beam hypotheses) and of
    `eval` (its greedy or beam decode): off by default, what both backends did without them. One that would do
    nothing is refused: any of them with `predict.pool: sample`, `length_penalty` with a beam of 1."""

    no_repeat_ngram_size: int = Field(0, ge=0)
    """No n-gram of this many tokens occurs twice in a hypothesis (0: no limit; 3 is what BART's summarisation
    checkpoints ship with). Samples are drawn without it."""
    repetition_penalty: float = Field(1.0, ge=1.0, le=100.0)
    """A token the hypothesis already holds has its score divided by this when positive, multiplied when negative
    (1: none; 1.2 is common). Samples are drawn without it."""
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    """Beam search: a finished hypothesis ranks by its log-probability divided by its length to this power (1: the
    mean per token; 0: the sum, which favours short ones; 2.0 is what BART's summarisation checkpoints ship with,
    0.6 is common in translation; greedy decoding, a beam of 1, has nothing to rank). Samples are drawn without it."""
    min_new_tokens: int = Field(0, ge=0)
    """No EOS before this many generated tokens (0: none; below `max_new_tokens`). Samples are drawn without it."""

    def search_controls(self) -> dict[str, int | float]:
        """The four controls by name (rlt2t.common.search.search_arguments takes them)."""
        return {key: getattr(self, key) for key in SearchControls.model_fields}

    def _check_controls(self, section: str, max_new_tokens: int, *, beam: tuple[str, int],
                        no_search: str | None) -> None:
        """Refuse a control that would do nothing: ``no_search`` says why the decode has no search for the
        controls to act on (None: it has one); ``beam`` is the beam size's key and value (a beam of 1 has nothing
        for length_penalty to rank)."""
        if self.min_new_tokens >= max_new_tokens:
            raise ValueError(f"{section}.min_new_tokens={self.min_new_tokens} must be below {section}.max_new_tokens="
                             f"{max_new_tokens} (which counts the EOS)")
        fields = SearchControls.model_fields
        changed = [key for key in fields if getattr(self, key) != fields[key].default]
        if no_search is not None and changed:
            raise ValueError(f"{section}.{changed[0]}={getattr(self, changed[0])} would do nothing: {no_search}; "
                             f"leave {' and '.join(f'{section}.{key}' for key in changed)} at the default")
        key, size = beam
        if size == 1 and "length_penalty" in changed:
            raise ValueError(f"{section}.length_penalty={self.length_penalty} would do nothing: it ranks finished beam "
                             f"hypotheses by length and {section}.{key}=1 searches with one; set {section}.{key} "
                             f"above 1 or leave {section}.length_penalty at 1")


class PredictConfig(SearchControls):
    backend: Literal["auto", "ct2", "torch"] = "auto"
    """Runtime of generators and scorers: `ct2` (exports, or model directories exported on the fly), `torch`
    (model directories on Hugging Face), `auto` (CTranslate2 where the model's family converts, else torch)."""
    beam_size: int = Field(10, ge=1)
    """Beam size of each generator."""
    num_hypotheses: int = Field(4, ge=1)
    """Hypotheses kept per input per generator."""
    pool: Literal["beam", "sample", "both"] = "beam"
    """Candidates of each generator per input: its `num_hypotheses` beam hypotheses, `num_samples` samples, or
    both (the pool every rerank mode, and `rlt2t eval --rerank`, picks from)."""
    num_samples: int = Field(16, ge=1)
    """Samples per input per generator when `pool` samples (duplicates count as separate entries for MBR)."""
    top_k: int = Field(0, ge=0)
    """Sampling of the pool: the k most likely next tokens (0: no top-k filter)."""
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    """Sampling of the pool: the nucleus, the most likely tokens up to this probability mass (1: no filter)."""
    epsilon: float = Field(0.0, ge=0.0, lt=1.0)
    """Sampling of the pool: tokens under this probability are not drawn (epsilon sampling, after top-k and top-p;
    0: no filter; e.g. 0.02 with top_p 1 for an MBR pool). Torch backend only: CTranslate2 has no such filter."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling of the pool: logits are divided by this."""
    seed: int = Field(0, ge=0)
    """Sampling of the pool: same seed, models and inputs, same samples."""
    rerank: PredictRerank = "mean_logprob"
    """How candidates are ranked (see `rlt2t predict --help`)."""
    mbr_utility: str = "task_score"
    """Utility of `rerank: mbr`: a registered metric that reads its reference (task_score, bleu4, cider_d, sacrebleu,
    rouge_l, chrf, ...; CIDEr-D's document frequencies from data.train; not mean_length or distinct_n), or
    `reward`: reward.terms with the other candidate as the reference. Checked before any model is exported."""
    mbr_weights: Literal["uniform", "probability"] = "uniform"
    """MBR's expectation (docs/design.md, "Minimum-Bayes-risk decoding"): `uniform`, each candidate against the
    pool's other entries, duplicates counted (for sampled pools); `probability`, against every distinct candidate,
    itself included, weighted by its sequence probability under the scorers (the exponential of its total log-prob
    averaged over scorers, normalised over the distinct candidates)."""
    max_pool: int = Field(256, ge=2)
    """Largest MBR pool per input (generators x candidates each, duplicates included): the utility costs its
    square; a larger configured pool is refused before decoding."""
    idf_max_n: int = Field(2, ge=1, le=4)
    """Longest n-gram of the IDF rerank."""
    consensus_top: int = Field(8, ge=2)
    """Candidates (by mean log-prob) among which consensus is measured."""
    batch_size: int = Field(32, ge=1)
    """Inputs per generator/scorer call."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated candidate."""

    @model_validator(mode="after")
    def _lengths(self) -> PredictConfig:
        self._check_controls("predict", self.max_new_tokens, beam=("beam_size", self.beam_size), no_search=(
            "the search controls shape beam hypotheses and predict.pool=sample draws samples only (set "
            "predict.pool=both for both)" if self.pool == "sample" else None))
        return self


class AnnotateConfig(_Section):
    """Human annotation: the web app (`rlt2t annotate serve`) and the terminal loop share one database."""

    database_url: str = "sqlite:///{run}/annotate/annotations.db"
    """SQLAlchemy URL of the annotation database: SQLite in the run directory by default, or PostgreSQL,
    e.g. `postgresql+psycopg://user:password@host/dbname` (`{run}` expands to run.dir)."""
    host: str = "127.0.0.1"
    """Bind address of the web app; loopback by default (put a TLS proxy in front to expose it)."""
    port: int = Field(8002, ge=0, le=65535)
    """Port of the web app (0: any free port)."""
    mode: Literal["rank", "rate"] = "rank"
    """What the web app asks for: order the candidates best first (`rank`) or rate each one (`rate`)."""
    rating_min: float = -2.0
    """Lowest rating (the seed tutorial's terminal loop used -2.0 ~ 2.0)."""
    rating_max: float = 2.0
    """Highest rating."""
    rating_step: float = Field(0.5, gt=0.0)
    """Step of the web app's rating sliders (the terminal accepts any number in range)."""
    num_candidates: int = Field(4, ge=1, le=32)
    """K: candidates sampled per source when items come from a policy server."""
    top_k: int = Field(0, ge=0)
    """Sampling for annotation: the k most likely next tokens (0: the whole vocabulary)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling for annotation: logits are divided by this."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest sampled candidate in tokens."""
    policy_url: str = "http://127.0.0.1:8000"
    """Policy server sampled by `rlt2t annotate load --sources` and `annotate terminal --sources`."""
    shuffle_candidates: bool = True
    """Show each annotator the candidates in their own fixed random order (against position bias)."""
    max_annotators_per_item: int = Field(0, ge=0)
    """Stop offering an item once this many annotators judged it (ranked or rated; skips do not count; 0: everyone
    annotates everything)."""
    max_candidates_per_item: int = Field(16, ge=1, le=256)
    """Most candidates one item may hold (a longer list in a candidates file is an error)."""
    max_text_chars: int = Field(10_000, ge=1)
    """Most characters of one source or candidate text."""
    max_body_bytes: int = Field(64 * 1024, ge=1024)
    """Largest request body the web app accepts (413 beyond it, before parsing or authentication)."""
    session_hours: float = Field(12.0, gt=0.0)
    """A browser login lasts this long."""
    secure_cookies: bool = False
    """Mark the login cookie Secure (set it when the app is served over HTTPS)."""
    include_flagged: bool = False
    """Exports include annotations of items the annotator flagged (they are left out by default)."""

    @model_validator(mode="after")
    def _rating_range(self) -> AnnotateConfig:
        if not self.rating_min < self.rating_max:
            raise ValueError(f"annotate.rating_min={self.rating_min} must be below annotate.rating_max="
                             f"{self.rating_max}")
        if self.rating_step > self.rating_max - self.rating_min:
            raise ValueError(f"annotate.rating_step={self.rating_step} is wider than the rating range")
        return self
