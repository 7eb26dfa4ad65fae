"""The one typed config tree.

Defaults here *are* the embedded default run (`make demo`): local, CPU, synthetic data, the `small`
preset. YAML files in ``configs/`` override them, and ``a.b=value`` arguments override the YAML.
Unknown keys, wrong types and impossible values fail with a message naming the key
(``sft.lr: must be > 0``). Each component receives only its own sub-config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    # Attribute docstrings become field descriptions (shown by `rlt2t config --explain`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending key."""


class RunConfig(_Section):
    dir: str = "runs/demo"
    """Output directory of the run: data, tokenizer, checkpoints, logs and reports go under it."""
    seed: int = 1234
    """Seed for every random choice (data order, noise, dropout, sampling)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` takes CUDA when present."""
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    """Mixed precision through accelerate (GPU only; CPU runs in float32)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 leaves torch's default."""
    log_every: int = Field(10, ge=1)
    """Log training metrics every this many optimizer steps."""
    progress: bool = True
    """Show progress bars on long work."""


class SynthConfig(_Section):
    size: int = Field(4000, ge=1, le=1_000_000)
    """Number of synthetic rows (train + valid + test)."""
    seed: int = 7
    """Seed of the synthetic generator: same seed, same bytes."""
    valid_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    """Fraction of rows in the validation split."""
    test_fraction: float = Field(0.05, ge=0.0, lt=0.5)
    """Fraction of rows in the held-out test split."""


class DataConfig(_Section):
    train: str = "{run}/data/train.jsonl"
    """Training JSONL (`id`, `source`, `target`); `{run}` expands to run.dir."""
    valid: str = "{run}/data/valid.jsonl"
    """Validation JSONL."""
    test: str = "{run}/data/test.jsonl"
    """Held-out test JSONL (targets optional)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines stop the run (`raise`) or are skipped and counted in the log (`skip`)."""
    max_source_len: int = Field(128, ge=2)
    """Source tokens kept (longer sources are truncated, with a count in the log)."""
    max_target_len: int = Field(64, ge=2)
    """Target tokens kept, EOS included."""


class TokenizerConfig(_Section):
    kind: Literal["ids", "subword", "pretrained"] = "ids"
    """`ids`: space-separated integer tokens (data token k = model id k + offset); `subword`: a BPE
    trained on the training file; `pretrained`: a saved Hugging Face tokenizer directory (`path`)."""
    path: str | None = None
    """Tokenizer directory to load (`pretrained`), or where to save a built one (default {run}/tokenizer)."""
    num_data_tokens: int = Field(1894, ge=1)
    """`ids` only: data tokens 0..N-1; the model vocabulary is offset + N."""
    num_sentinels: int = Field(100, ge=1)
    """Sentinel tokens for span corruption (`ids` and `subword`)."""
    vocab_size: int = Field(8000, ge=64)
    """`subword` only: BPE vocabulary size."""


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "base"] | None = "small"
    """Build from scratch with this shape: `tiny` (tests), `small` (a few M params), `base` (BART-base)."""
    path: str | None = None
    """A local pretrained BART directory (`from_pretrained`); takes precedence over `preset`."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout of a model built from a preset (also applied to a loaded model)."""


class StageConfig(_Section):
    """Optimisation settings shared by the training stages."""

    enabled: bool = True
    """Run this stage in the pipeline."""
    epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps (0: no limit)."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step (per process)."""
    lr: float = Field(2e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Fraction of steps of linear warmup."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Linear decay ends at this fraction of the peak learning rate (the floor)."""
    grad_clip: float = Field(0.5, gt=0.0)
    """Gradient-norm clipping."""
    save_every_steps: int = Field(0, ge=0)
    """Also checkpoint every N steps (0: at the end of each epoch only)."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept (oldest deleted first)."""


class PretrainConfig(StageConfig):
    lr: float = Field(5e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    max_steps: int = Field(150, ge=0)
    """Stop after this many optimizer steps (0: no limit; the demo keeps pretraining short)."""
    noise_density: float = Field(0.15, gt=0.0, lt=1.0)
    """Fraction of tokens masked by span corruption."""
    mean_span_length: float = Field(3.0, ge=1.0)
    """Mean length of a masked span."""


class SFTConfig(StageConfig):
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate (the original used 2e-5 on a pretrained BART-base; scratch models want more)."""
    epochs: int = Field(4, ge=1)
    """Passes over the training data."""
    rdrop_alpha: float = Field(0.0, ge=0.0)
    """R-drop weight of the symmetric KL between two dropout passes (0 disables R-drop)."""
    augment_prob: float = Field(0.0, ge=0.0, lt=1.0)
    """Input augmentation: fraction of source tokens deleted or repeated 1-3 times (0 disables)."""
    fgm_epsilon: float = Field(0.0, ge=0.0)
    """FGM adversarial step size on the shared embedding (0 disables)."""


class RankConfig(StageConfig):
    """Rank RL: CE(gold) + λ·pairwise rank loss on sampled (better, worse) pairs."""

    epochs: int = Field(2, ge=1)
    """Passes over the training sources."""
    lr: float = Field(2e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of steps of linear warmup."""
    batch_size: int = Field(32, ge=1)
    """Pairs per optimizer step, over all learner ranks (must divide by learners)."""
    loss_weight: float = Field(0.2, ge=0.0)
    """λ in CE(gold) + λ·rank (0 = continue SFT on the gold targets only)."""
    score: Literal["logits", "logprobs"] = "logprobs"
    """Token score of the rank loss: the raw logit (the original) or the log-probability (matches reranking)."""
    delay_alpha: float = Field(0.95, gt=0.0, le=1.0)
    """α of the first-difference delay weights α^(t-s)."""
    refresh_every_steps: int = Field(0, ge=0)
    """Publish new weights to the rollout workers every N learner steps (0: once per epoch, the original)."""
    train_subset: int = Field(1024, ge=0)
    """Use only the first N training sources (0: all). The embedded default keeps the CPU demo short;
    set 0 for real runs (the job logs how many sources it uses)."""
    learners: int = Field(1, ge=1)
    """Learner ranks forming one DDP world (gloo on CPU, nccl on GPU)."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout actors sampling candidates."""
    reward_workers: int = Field(1, ge=1)
    """Reward actors scoring candidates with the task metric."""
    chunk_size: int = Field(32, ge=1)
    """Sources per rollout task (the unit of work re-dispatched when a worker dies)."""
    max_inflight_chunks: int = Field(8, ge=1)
    """Bound on rollout chunks sampled ahead of the learner (the queue bound)."""
    deterministic: bool | None = None
    """Results independent of worker timing: seeds from (seed, version, example id), batches in dataset
    order (None: on for CPU runs)."""
    learner_gpus: float = Field(0.0, ge=0.0)
    """GPUs per learner rank (placement group bundles)."""
    rollout_gpus: float = Field(0.0, ge=0.0)
    """GPU fraction per rollout worker."""
    learner_cpus: float = Field(1.0, gt=0.0)
    """CPUs per learner rank."""
    rollout_cpus: float = Field(1.0, gt=0.0)
    """CPUs per rollout worker."""
    reward_cpus: float = Field(0.5, gt=0.0)
    """CPUs per reward worker."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray resources per learner rank, e.g. {"accelerator_type:H100": 0.001} (placement group bundles)."""
    rollout_resources: dict[str, float] = Field(default_factory=dict)
    """Extra Ray resources per rollout worker (pins sampling to nodes that advertise them)."""
    max_restarts: int = Field(3, ge=0)
    """Ray restarts of a dead rollout/reward worker before the job fails."""
    preflight: bool = True
    """Each learner rank runs one forward/backward on the largest batch it can receive (rank.batch_size /
    learners pairs, data.max_source_len / max_target_len tokens) while the workers start: out-of-memory
    fails the job at setup, and the first step does not pay the fresh process's warm-up. No optimizer step,
    RNGs restored: training is unchanged."""


class RolloutConfig(_Section):
    num_samples: int = Field(6, ge=1)
    """K: candidates sampled per source (the gold target is added to them)."""
    top_k: int = Field(3, ge=0)
    """Sample among the k most likely next tokens (0: the whole vocabulary)."""
    temperature: float = Field(0.8, gt=0.0)
    """Logits are divided by this before sampling (< 1 sharpens, > 1 flattens)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest sampled candidate in tokens, EOS included."""
    batch_size: int = Field(32, ge=1)
    """Sources per sampling call (each expands to num_samples decoder rows)."""
    include_gold: bool = True
    """Add the gold target to each source's candidates before the pair is drawn."""
    source: Literal["ray", "http"] = "ray"
    """Where candidates come from: Ray rollout actors, or policy servers (`rollout.urls`)."""
    urls: list[str] = Field(default_factory=list)
    """Policy server base URLs for `source: http` (work is spread across them)."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Per-request timeout when sampling over HTTP."""
    backend: Literal["torch", "ct2"] = "torch"
    """Sampler of the rollout actors: torch, or CTranslate2 (weights converted at each published version)."""
    ct2_compute_type: Literal["default", "auto", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                              "float16", "bfloat16", "float32"] = "int8"
    """CTranslate2 compute type of the `ct2` backend (int8, int8_float32, float32, ...)."""


class RewardConfig(_Section):
    bleu_weight: float = Field(1 / 3, ge=0.0, le=1.0)
    """w in the pair reward (1-w)·CIDEr-D + w·BLEU-4 (the competition's 1/3)."""
    cider_sigma: float = Field(6.0, gt=0.0)
    """σ of CIDEr-D's Gaussian length penalty (6 is standard; the original used 15)."""
    source: Literal["ray", "http"] = "ray"
    """Where pairs are scored: Ray reward actors, or a reward server (`reward.url`)."""
    url: str | None = None
    """Reward server base URL for `source: http`."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Per-request timeout when scoring over HTTP."""


class EvalConfig(_Section):
    split: Literal["train", "valid", "test"] = "valid"
    """Split decoded by `rlt2t eval`."""
    num_beams: int = Field(1, ge=1)
    """1 = greedy decoding."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated target."""
    batch_size: int = Field(64, ge=1)
    """Sources per generate call."""
    limit: int = Field(0, ge=0)
    """Evaluate only the first N examples (0: all)."""


class MetricConfig(_Section):
    cider_sigma: float = Field(6.0, gt=0.0)
    """σ of CIDEr-D's Gaussian length penalty (6 is standard; the original used 15)."""
    bleu_weight: float = Field(1 / 3, ge=0.0, le=1.0)
    """w in the task score (1-w)·CIDEr-D + w·BLEU-4 of rewards and eval tables (the competition's 1/3)."""
    monitor_bleu_weight: float = Field(0.0, ge=0.0, le=1.0)
    """w of the per-epoch validation monitor that picks the best checkpoint (0, as the original)."""
    monitor_size: int = Field(200, ge=0)
    """Validation examples decoded after each epoch for the monitor (0: none)."""


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    """Bind address; loopback by default (set 0.0.0.0 deliberately, with a token)."""
    port: int = Field(8000, ge=0, le=65535)
    """Policy server port (0: any free port)."""
    reward_port: int = Field(8001, ge=0, le=65535)
    """Reward server port."""
    checkpoint_dir: str = "{run}/rank/checkpoints"
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
    quantization: Literal["int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16",
                          "float32"] = "int8"
    """CTranslate2 weight quantization."""
    out: str = "{run}/export"
    """Where `rlt2t export` writes (one subdirectory per exported model)."""
    threads: int = Field(0, ge=0)
    """CTranslate2 intra-op threads (0: its default)."""


class PredictConfig(_Section):
    beam_size: int = Field(10, ge=1)
    """Beam size of each generator."""
    num_hypotheses: int = Field(4, ge=1)
    """Hypotheses kept per input per generator."""
    rerank: Literal["mean_logprob", "idf", "consensus"] = "mean_logprob"
    """How candidates are ranked (see `rlt2t predict --help`)."""
    idf_max_n: int = Field(2, ge=1, le=4)
    """Longest n-gram of the IDF rerank."""
    consensus_top: int = Field(8, ge=2)
    """Candidates (by mean log-prob) among which consensus is measured."""
    batch_size: int = Field(32, ge=1)
    """Inputs per generator/scorer call."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated candidate."""


# Presets: (d_model, layers, heads, ffn, max positions). `base` is the BART-base shape.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(d_model=32, layers=1, heads=2, ffn=64, positions=256),
    "small": dict(d_model=256, layers=3, heads=4, ffn=1024, positions=256),
    "base": dict(d_model=768, layers=6, heads=12, ffn=3072, positions=1024),
}


class Config(_Section):
    run: RunConfig = RunConfig()
    synth: SynthConfig = SynthConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainConfig = PretrainConfig()
    sft: SFTConfig = SFTConfig()
    rank: RankConfig = RankConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    metric: MetricConfig = MetricConfig()
    serve: ServeConfig = ServeConfig()
    export: ExportConfig = ExportConfig()
    predict: PredictConfig = PredictConfig()

    @model_validator(mode="after")
    def _lengths_fit_positions(self) -> Config:
        # A pretrained directory is checked when it is loaded (its positions are in its config.json).
        if self.model.path is None and self.model.preset is not None:
            positions = PRESETS[self.model.preset]["positions"]
            for key in ("max_source_len", "max_target_len"):
                if getattr(self.data, key) > positions:
                    raise ValueError(
                        f"data.{key}={getattr(self.data, key)} exceeds the {positions} positions of "
                        f"model.preset={self.model.preset}"
                    )
        if self.rank.batch_size % self.rank.learners:
            raise ValueError(f"rank.batch_size={self.rank.batch_size} must divide by rank.learners={self.rank.learners}")
        if self.rollout.source == "http" and not self.rollout.urls:
            raise ValueError("rollout.source=http needs rollout.urls (policy server base URLs)")
        if self.reward.source == "http" and not self.reward.url:
            raise ValueError("reward.source=http needs reward.url (the reward server's base URL)")
        if self.predict.num_hypotheses > self.predict.beam_size:
            raise ValueError(f"predict.num_hypotheses={self.predict.num_hypotheses} exceeds predict.beam_size="
                             f"{self.predict.beam_size}")
        if self.eval.max_new_tokens > self.data.max_target_len * 4:
            raise ValueError("eval.max_new_tokens is more than 4x data.max_target_len; likely a typo")
        return self

    def path(self, template: str) -> Path:
        """Expand ``{run}`` in a configured path."""
        return Path(template.replace("{run}", self.run.dir))

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir)

    @property
    def tokenizer_dir(self) -> Path:
        return self.path(self.tokenizer.path) if self.tokenizer.path else self.run_dir / "tokenizer"


def _parse_value(text: str) -> Any:
    """`a.b=value` values are YAML scalars: 3, 0.5, true, null, [1, 2], "text"."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[: i + 1])}: is a value, cannot set {dotted}")
        node = child
    node[keys[-1]] = value


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif not key:  # a cross-field check: its message already names the keys
            lines.append(msg)
        else:
            lines.append(f"{key}: {msg} (got {e.get('input')!r})")
    return f"invalid config ({origin}):\n  " + "\n  ".join(lines)


def load_config(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """Merge YAML files (later wins) and ``a.b=value`` overrides onto the defaults, then validate."""
    tree: dict[str, Any] = {}
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _deep_merge(tree, loaded)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key.path=value")
        _set_dotted(tree, key.strip(), _parse_value(raw))
    origin = ", ".join([str(p) for p in paths] + list(overrides)) or "defaults"
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def explain(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per key: dotted name, default and the docstring; for `rlt2t config --explain`."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.extend(explain(ann, f"{prefix}{name}."))
        else:
            lines.append(f"{prefix}{name} = {field.default!r}  # {(field.description or '').splitlines()[0] if field.description else ''}")
    return lines
