"""The one typed config tree.

Defaults here *are* the embedded default run (`make demo`): local, CPU, synthetic data, the `small`
preset. YAML files in ``configs/`` override them, and ``a.b=value`` arguments override the YAML.
Unknown keys, wrong types and impossible values fail with a message naming the key
(``sft.lr: must be > 0``). Each component receives only its own sub-config.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import textwrap
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from rlt2t.common.family_table import FAMILIES, PRESETS, check_mixed_precision, family_of


def _numeric(annotation: Any) -> bool:
    """Whether a field holds a number and not a boolean (``float``, ``int | None``, ...)."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) is Annotated:
        return _numeric(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        return bool not in args and any(_numeric(a) for a in args)
    return False


def _boolean_numbers(tree: Any, model: type[BaseModel], prefix: str = "") -> list[str]:
    """The keys of ``tree`` (a config as loaded) that give a boolean for a number: pydantic reads true as 1 and
    false as 0, so `sft.lr=true` would train at lr 1.0."""
    if not isinstance(tree, dict):
        return []
    found = []
    for key, value in tree.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # unknown keys are pydantic's to name
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _boolean_numbers(value, annotation, f"{prefix}{key}.")
        elif isinstance(value, bool) and _numeric(annotation):
            found.append(f"{prefix}{key}: expected a number, got {str(value).lower()}")
    return found


class _Section(BaseModel):
    # Attribute docstrings become field descriptions (shown by `rlt2t config --explain`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def shared_directory(path: str | os.PathLike) -> str | None:
    """Why ``path`` is no place of its own for a run, or None: it resolves to the filesystem root, the home
    directory or the current directory, or to a parent of one of them (``..``). The one rule of ``run.dir``,
    checked when a config is loaded and again before ``demo --fresh`` deletes anything."""
    try:
        resolved = Path(path).expanduser().resolve()
    except RuntimeError:  # ~user with no such user: a literal name, nothing shared
        return None
    protected = {"the filesystem root": Path(resolved.anchor)}
    for what, where in (("the current directory", Path.cwd), ("the home directory", Path.home)):
        with contextlib.suppress(OSError, RuntimeError):  # a deleted cwd, no home directory: nothing to protect
            protected[what] = where().resolve()
    for what, place in protected.items():
        if resolved == place or resolved in place.parents:
            return f"resolves to {resolved}, {what}" + ("" if resolved == place else " or a parent of it")
    return None


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending key."""


class RunConfig(_Section):
    dir: str = Field("runs/demo", min_length=1, pattern=r"\S")
    """Output directory of the run: data, tokenizer, checkpoints, logs and reports go under it."""

    @model_validator(mode="after")
    def _a_directory_of_its_own(self) -> RunConfig:
        if (problem := shared_directory(self.dir)) is not None:
            raise ValueError(f"run.dir={self.dir!r} {problem}: the run needs a directory of its own (it writes "
                             "data/, checkpoints and logs under it); e.g. run.dir=runs/demo")
        return self
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
    """Training data (`id`, `source`, `target` by default: data.*_field): a JSONL, CSV or Parquet file or a
    Hugging Face datasets directory (data.format); `{run}` expands to run.dir."""
    valid: str = "{run}/data/valid.jsonl"
    """Validation data (as data.train)."""
    test: str = "{run}/data/test.jsonl"
    """Held-out test data (as data.train; targets optional)."""
    format: Literal["auto", "jsonl", "csv", "parquet", "datasets"] = "auto"
    """How data files are read. `auto`: by the path (a directory or `.arrow` file: datasets; `.parquet`/`.pq`:
    Parquet; `.csv`/`.tsv`: CSV with a header; else JSONL). `datasets` on a `.jsonl`/`.csv`/`.parquet` file loads
    it through `datasets.load_dataset` (a memory-mapped Arrow cache)."""
    id_field: str = Field("id", min_length=1)
    """Field (column) of the example ids; a CSV, Parquet or datasets file without it numbers its rows 1, 2, ..."""
    source_field: str = Field("source", min_length=1)
    """Field (column) of the source texts."""
    target_field: str = Field("target", min_length=1)
    """Field (column) of the target texts (optional when data.references_field gives references)."""
    references_field: str = Field("references", min_length=1)
    """Field (column) of a row's several references: a list of strings (in a CSV cell, a JSON list)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines (rows) stop the run (`raise`) or are skipped and counted in the log (`skip`)."""

    @model_validator(mode="after")
    def _distinct_fields(self) -> DataConfig:
        names = [self.id_field, self.source_field, self.target_field, self.references_field]
        if len(set(names)) < len(names):
            raise ValueError(f"data.id_field, source_field, target_field and references_field must name different "
                             f"fields, got {', '.join(map(repr, names))}")
        return self
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


class LoraConfig(_Section):
    """LoRA adapters (through peft): only the low-rank adapter weights are trained, checkpointed and published."""

    enabled: bool = False
    """Train LoRA adapters on a frozen base instead of every weight (needs a pretrained base directory)."""
    r: int = Field(8, ge=1)
    """Rank of each adapter's update B·A."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale: the update is (alpha / r)·B·A."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapters' input."""
    target_modules: list[str] | None = None
    """Names of the linear layers to adapt (None: the family's attention query/value projections, by the
    model's config.model_type: q_proj/v_proj for bart, mbart, marian, pegasus; q/v for t5, mt5)."""


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "base"] | None = "small"
    """Build from scratch with this shape: `tiny` (tests), `small` (a few M params), `base` (BART-base)."""
    family: Literal["bart", "t5", "marian", "mbart", "pegasus"] = "bart"
    """Architecture of a from-scratch preset (a loaded directory's family comes from its config.json)."""
    path: str | None = None
    """A local pretrained encoder-decoder directory (BART, T5/Flan-T5/mT5, Marian, mBART, Pegasus, or a
    warm-started EncoderDecoderModel); takes precedence over `preset`."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout of a model built from a preset (also applied to a loaded model)."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (model.lora.enabled, r, alpha, dropout, target_modules)."""
    src_lang: str | None = None
    """mBART: source language code (e.g. en_XX); the tokenizer adds it to every text it encodes."""
    tgt_lang: str | None = None
    """mBART: target language code (e.g. ro_RO); decoding starts from it (None: the model's own start)."""


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
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps (0: no limit, `epochs` full passes; the default, one pass, is what the
    demo's from-scratch model needs before SFT learns on every seed)."""
    noise_density: float = Field(0.15, gt=0.0, lt=1.0)
    """Fraction of tokens masked by span corruption."""
    mean_span_length: float = Field(3.0, ge=1.0)
    """Mean length of a masked span."""


class SFTConfig(StageConfig):
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate (the original used 2e-5 on a pretrained BART-base; scratch models want more)."""
    epochs: int = Field(6, ge=1)
    """Most passes over the training data (the learning-rate schedule spans them all; `patience` may stop
    sooner)."""
    patience: int = Field(1, ge=0)
    """Stop once the validation monitor has not beaten its best for this many epochs in a row (0: run every
    epoch). Epochs whose greedy outputs have collapsed do not count. The best checkpoint is what later stages
    start from either way; needs a validation split."""
    rdrop_alpha: float = Field(0.0, ge=0.0)
    """R-drop weight of the symmetric KL between two dropout passes (0 disables R-drop)."""
    augment_prob: float = Field(0.0, ge=0.0, lt=1.0)
    """Input augmentation: fraction of source tokens deleted or repeated 1-3 times (0 disables)."""
    fgm_epsilon: float = Field(0.0, ge=0.0)
    """FGM adversarial step size on the shared embedding (0 disables)."""


class RankLossConfig(_Section):
    """Rank RL's loss: CE(gold) + λ·pairwise rank loss on sampled (better, worse) pairs."""

    loss_weight: float = Field(0.2, ge=0.0)
    """λ in CE(gold) + λ·rank (0 = continue SFT on the gold targets only)."""
    score: Literal["logits", "logprobs"] = "logprobs"
    """Token score of the rank loss: the raw logit (the original) or the log-probability (matches reranking)."""
    delay_alpha: float = Field(0.95, gt=0.0, le=1.0)
    """α of the first-difference delay weights α^(t-s)."""


class KLConfig(_Section):
    """The KL to the reference policy (the starting checkpoint, frozen) of the policy-gradient algorithms."""

    coef: float = Field(0.05, ge=0.0)
    """β: the KL coefficient (initial value when adaptive). 0 turns the KL term off (no reference scoring)."""
    target: float | None = Field(None, gt=0.0)
    """Adaptive controller (Ziegler et al.): target KL per sequence in nats; null keeps β fixed."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon, in sequences."""

    @model_validator(mode="after")
    def _adaptive_needs_a_start(self) -> KLConfig:
        if self.target is not None and self.coef == 0:
            raise ValueError("rl.kl.target: the adaptive controller scales β and cannot move it off rl.kl.coef=0; "
                             "give rl.kl.coef a starting value > 0 (or drop the target)")
        return self


class PolicyGradientConfig(_Section):
    """Settings shared by SCST, RLOO, GRPO, PPO, A2C and NLPO (docs/design.md, "Policy-gradient algorithms")."""

    clip_eps: float = Field(0.2, gt=0.0)
    """ε of the clipped ratio (A2C ignores it: no clipping)."""
    is_cap: float = Field(2.0, ge=1.0)
    """Truncated importance sampling: cap of the learner-to-sampler probability ratio that weights each token
    (corrects an int8 or stale sampler; 1 on-policy with the torch sampler)."""
    epochs: int | None = Field(None, ge=1)
    """Optimisation passes over each batch of experience (null: 2 for PPO and NLPO, 1 otherwise)."""
    minibatches: int | None = Field(None, ge=1)
    """Minibatches per pass, split by source (null: 2 for PPO and NLPO, 1 otherwise)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight (token mean of the policy's entropy)."""
    target_kl: float = Field(0.05, ge=0.0)
    """Stop a batch's remaining optimizer steps once the approximate KL to the batch's start exceeds 1.5x this
    (0: never; it only matters for PPO/NLPO's several steps per batch)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """PPO/A2C/NLPO discount of GAE."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """PPO/A2C/NLPO λ of GAE."""
    vf_coef: float = Field(0.5, ge=0.0)
    """Value-loss weight (PPO, A2C, NLPO)."""
    value_clip: float = Field(0.2, gt=0.0)
    """ε_v of the clipped value loss (A2C: unclipped)."""
    whiten_advantages: bool = True
    """PPO/A2C/NLPO: whiten advantages over the batch's valid tokens."""
    grpo_scale: Literal["group", "batch", "none"] = "batch"
    """GRPO: what divides each sample's reward minus its source's mean reward. `batch` (the default): the std of
    those differences over the whole batch (every rank), so a source weighs by how far apart its rewards are, and
    the step is still independent of the reward's scale. `group`: the std of the source's K rewards (the paper's
    GRPO; the default of earlier versions, CHANGELOG.md): every source whose rewards differ at all gets advantages
    of about +-1, however little they differ. `none`: nothing (Dr. GRPO; the step then scales with the reward)."""
    nlpo_top_p: float = Field(0.9, gt=0.0, le=1.0)
    """NLPO: the action space is the top-p tokens of the masking policy."""
    nlpo_mask_refresh_steps: int = Field(10, ge=1)
    """NLPO: the masking policy is a copy of the policy refreshed every N learner steps."""
    sft_coef: float = Field(0.0, ge=0.0)
    """Weight of a likelihood term: cross-entropy on each source's gold target (token mean over the gold tokens),
    added to every optimizer step's loss, as InstructGPT's PPO-ptx adds its pretraining term; meant for an SFT
    that has not converged, where continued SFT still gains (docs/design.md, "Policy-gradient algorithms"; on
    the benchmark's pilot it added nothing to GRPO). 0: off. Not for rank RL, which has its own CE."""
    nlpo_leak_coef: float = Field(1.0, ge=0.0)
    """NLPO: weight of the loss term -log(policy mass inside the mask), token mean. The masked loss does not
    reach the logits of masked-out tokens; without this term mass drifts outside the mask unseen until a
    refresh lets it in (one synthetic-benchmark seed in three collapsed that way). 0 turns it off."""


class RLConfig(StageConfig):
    """The RL job on Ray: rollout and reward actors feeding a DDP learner group (`rlt2t train`)."""

    algorithm: Literal["rank", "scst", "rloo", "grpo", "ppo", "a2c", "nlpo"] = "grpo"
    """`scst`, `rloo`, `grpo`: group policy gradients (grpo: the default, the benchmark's most consistent gain over
    continued SFT); `ppo`, `a2c`, `nlpo`: token-level actor-critic; `rank`: CE + λ·pairwise rank loss
    (rlt2t's original, the cheapest step). docs/design.md defines each."""
    epochs: int = Field(2, ge=1)
    """Passes over the training sources."""
    lr: float = Field(2e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of steps of linear warmup."""
    batch_size: int = Field(32, ge=1)
    """Sources per learner step over all learner ranks (rank: one pair each; others: K samples each); must
    divide by learners."""
    rank: RankLossConfig = RankLossConfig()
    kl: KLConfig = KLConfig()
    pg: PolicyGradientConfig = PolicyGradientConfig()
    refresh_every_steps: int | None = Field(None, ge=0)
    """Publish new weights to the rollout workers every N learner steps (0: once per epoch, the original rank
    RL; null: 0 for rank, 1 for the policy gradients, whose samples should be at most a step stale)."""
    train_subset: int = Field(1024, ge=0)
    """Use only the first N training sources (0: all). The embedded default keeps the CPU demo short; set 0
    for real runs (the job logs how many sources it uses)."""
    learners: int = Field(1, ge=1)
    """Learner ranks forming one DDP world (gloo on CPU, nccl on GPU)."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout actors sampling candidates."""
    reward_workers: int = Field(1, ge=1)
    """Reward actors scoring candidates with the reward."""
    chunk_size: int = Field(32, ge=1)
    """Sources per rollout task (the unit of work re-dispatched when a worker dies). It must divide
    rl.batch_size; left unset, the largest divisor of rl.batch_size up to 32."""
    max_inflight_chunks: int = Field(8, ge=1)
    """Bound on rollout chunks sampled ahead of the learner (the queue bound)."""
    deterministic: bool | None = None
    """Results independent of worker timing: seeds from (seed, version, example id), batches in dataset order
    (null: on for CPU runs)."""
    learner_gpus: float = Field(0.0, ge=0.0)
    """GPUs per learner rank (placement group bundles)."""
    rollout_gpus: float = Field(0.0, ge=0.0)
    """GPU fraction per rollout worker; with one, it samples on the GPU (the torch backend)."""
    reward_gpus: float = Field(0.0, ge=0.0)
    """GPU fraction per reward worker, for learned reward terms on ``reward.device`` (without one, Ray hides
    the GPUs from it and `auto` runs them on the CPU)."""
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
    schedule_timeout_s: float = Field(300.0, gt=0.0)
    """A worker or learner rank that the cluster cannot place within this many seconds fails the job, naming
    the resources it asked for."""
    preflight: bool = True
    """Each learner rank runs one forward/backward on the largest batch it can receive (rl.batch_size /
    learners sources, data.max_source_len / max_target_len tokens) while the workers start: out-of-memory
    fails the job at setup, and the first step does not pay the fresh process's warm-up. No optimizer step,
    RNGs restored: training is unchanged."""

    @model_validator(mode="after")
    def _likelihood_term_is_for_policy_gradients(self) -> RLConfig:
        if self.algorithm == "rank" and self.pg.sft_coef:
            raise ValueError("rl.pg.sft_coef: rank RL already trains on the gold targets (its CE term, with "
                             "rl.rank.loss_weight weighing the rank loss against it); the likelihood term is for the "
                             "policy-gradient algorithms")
        return self

    @property
    def refresh_interval(self) -> int:
        """``refresh_every_steps`` resolved: 0 (per epoch) for rank RL, 1 for the policy gradients by default."""
        if self.refresh_every_steps is not None:
            return self.refresh_every_steps
        return 0 if self.algorithm == "rank" else 1

    @property
    def uses_kl(self) -> bool:
        """Whether the algorithm's loss or reward has a KL to the reference (rank RL has none)."""
        return self.algorithm != "rank" and self.kl.coef > 0

    @property
    def ppo_like(self) -> bool:
        """Token-level actor-critic with a value head (PPO, A2C, NLPO)."""
        return self.algorithm in ("ppo", "a2c", "nlpo")

    @property
    def optimisation_epochs(self) -> int:
        if self.algorithm == "a2c":
            return 1
        return self.pg.epochs or (2 if self.algorithm in ("ppo", "nlpo") else 1)

    @property
    def optimisation_minibatches(self) -> int:
        if self.algorithm == "a2c":
            return 1
        return self.pg.minibatches or (2 if self.algorithm in ("ppo", "nlpo") else 1)


# The retired `rank:` section: the RL job's settings are under `rl.*`, the rank loss's under `rl.rank.*`.
RANK_LOSS_KEYS = ("loss_weight", "score", "delay_alpha")


def _retired_keys(tree: dict[str, Any]) -> list[str]:
    """One message per key of the retired `rank:` section, naming where it lives now."""
    rank = tree.get("rank")
    if rank is None:
        return []
    if not isinstance(rank, dict):
        return ["rank: the RL job's section is now `rl` (e.g. rl.epochs, rl.algorithm=rank)"]
    return [f"rank.{k}: moved to {'rl.rank.' if k in RANK_LOSS_KEYS else 'rl.'}{k}" for k in rank]


class RolloutConfig(_Section):
    num_samples: int = Field(6, ge=1)
    """K: candidates sampled per source (rank RL adds the gold target to them)."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely next tokens (0: the whole vocabulary, sampling the policy itself, what the
    policy gradients want; the original rank RL used 3)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the most likely tokens whose mass reaches p (1: off; torch backend only)."""
    temperature: float = Field(1.0, gt=0.0)
    """Logits are divided by this before sampling (< 1 sharpens, > 1 flattens; the original rank RL used 0.8)."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest sampled candidate in tokens, EOS included (the policy gradients: at most data.max_target_len; left
    unset, it is lowered to that)."""
    batch_size: int = Field(32, ge=1)
    """Sources per sampling call (each expands to num_samples decoder rows)."""
    include_gold: bool = True
    """Rank RL: add the gold target to each source's candidates before the pair is drawn."""
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
    """Reward-model directory, or a checkpoint root (its newest complete checkpoint; the reward server
    hot-reloads newer ones)."""
    weight: float = 1.0
    """Coefficient of this term in the weighted sum."""
    batch_size: int = Field(64, ge=1)
    """Candidates per model call."""


class ClassifierTerm(_Section):
    """A sequence classifier's probability (or logit) of one label, e.g. a sentiment or intent model."""

    kind: Literal["classifier"] = "classifier"
    """Term type tag."""
    path: str
    """A local sequence-classification directory (`rlt2t classifier train` or any Hugging Face one)."""
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
    or any local encoder / sequence-classification directory (source and candidate as a text pair).
    None: the run's best SFT checkpoint."""
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
    """Backbone: a local encoder or sequence-classification directory (required)."""
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


class EvalConfig(_Section):
    split: Literal["train", "valid", "test"] = "valid"
    """Split decoded by `rlt2t eval`."""
    num_beams: int = Field(1, ge=1)
    """1 = greedy decoding."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated target (left unset, at most 4x data.max_target_len)."""
    batch_size: int = Field(64, ge=1)
    """Sources per generate call."""
    limit: int = Field(0, ge=0)
    """Evaluate only the first N examples (0: all)."""
    metrics: list[str] = ["cider_d", "bleu4", "task_score", "rouge_l", "mean_length"]  # pydantic copies the default
    """Columns of the eval table: registered metric names (rouge1, meteor, sacrebleu, distinct_2, ...) and
    `perplexity` (of the references under the model); `rlt2t eval --metrics` overrides it."""
    classifier_path: str | None = None
    """Sequence-classification model directory for the `classifier_accuracy` column (`{run}` expands)."""
    classifier_label_field: str | None = None
    """JSONL field holding each example's expected class (e.g. `intent`); None: the classifier's label of the
    reference is expected."""


class MetricConfig(_Section):
    cider_sigma: float = Field(6.0, gt=0.0)
    """σ of CIDEr-D's Gaussian length penalty (6 is standard; the original used 15), of evaluation and, unless
    `reward.cider_sigma` is set, of the rewards."""
    bleu_weight: float = Field(1 / 3, ge=0.0, le=1.0)
    """w in the task score (1-w)·CIDEr-D + w·BLEU-4 of eval tables and, unless `reward.bleu_weight` is set, of
    the rewards (the competition's 1/3)."""
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
    backend: Literal["auto", "ct2", "torch"] = "auto"
    """Runtime of generators and scorers: `ct2` (exports, or model directories exported on the fly), `torch`
    (model directories on Hugging Face), `auto` (CTranslate2 where the model's family converts, else torch)."""
    beam_size: int = Field(10, ge=1)
    """Beam size of each generator."""
    num_hypotheses: int = Field(4, ge=1)
    """Hypotheses kept per input per generator."""
    rerank: Literal["mean_logprob", "idf", "consensus", "reward"] = "mean_logprob"
    """How candidates are ranked (see `rlt2t predict --help`)."""
    idf_max_n: int = Field(2, ge=1, le=4)
    """Longest n-gram of the IDF rerank."""
    consensus_top: int = Field(8, ge=2)
    """Candidates (by mean log-prob) among which consensus is measured."""
    batch_size: int = Field(32, ge=1)
    """Inputs per generator/scorer call."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated candidate."""


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


class Config(_Section):
    run: RunConfig = RunConfig()
    synth: SynthConfig = SynthConfig()
    data: DataConfig = DataConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    pretrain: PretrainConfig = PretrainConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    classifier: ClassifierConfig = ClassifierConfig()
    feedback: FeedbackConfig = FeedbackConfig()
    eval: EvalConfig = EvalConfig()
    metric: MetricConfig = MetricConfig()
    serve: ServeConfig = ServeConfig()
    export: ExportConfig = ExportConfig()
    predict: PredictConfig = PredictConfig()
    annotate: AnnotateConfig = AnnotateConfig()

    @model_validator(mode="after")
    def _reward_follows_metric(self) -> Config:
        # The rewards optimise the metric the run is judged on, unless told otherwise.
        for key in ("bleu_weight", "cider_sigma"):
            if key not in self.reward.model_fields_set:
                setattr(self.reward, key, getattr(self.metric, key))
                self.reward.model_fields_set.discard(key)  # still unset: follows metric.* again on another load
        return self

    @model_validator(mode="after")
    def _lengths_fit_positions(self) -> Config:
        # A pretrained directory is checked when it is loaded (its positions are in its config.json).
        if self.model.path is None and self.model.preset is not None and FAMILIES[self.model.family].learned_positions:
            positions = PRESETS[self.model.preset]["positions"]  # T5's relative positions have no limit
            for key in ("max_source_len", "max_target_len"):
                if getattr(self.data, key) > positions:
                    raise ValueError(
                        f"data.{key}={getattr(self.data, key)} exceeds the {positions} positions of "
                        f"model.preset={self.model.preset}"
                    )
        if self.rl.batch_size % self.rl.learners:
            raise ValueError(f"rl.batch_size={self.rl.batch_size} must divide by rl.learners={self.rl.learners}")
        if self.rl.batch_size % self.rl.chunk_size:
            # No chunk may straddle two learner steps: a run resumed between them would cut it elsewhere and
            # sample part of it with another policy version.
            if "chunk_size" in self.rl.model_fields_set:
                raise ValueError(f"rl.chunk_size={self.rl.chunk_size} must divide rl.batch_size={self.rl.batch_size}"
                                 ", so that no chunk straddles two learner steps (a run resumed between them would "
                                 "sample part of it with another policy version)")
            self.rl.chunk_size = max(d for d in range(1, self.rl.chunk_size + 1) if self.rl.batch_size % d == 0)
            self.rl.model_fields_set.discard("chunk_size")  # still unset: derived again for another batch size
        if self.rl.algorithm != "rank":
            if self.rollout.max_new_tokens > self.data.max_target_len and "max_new_tokens" not in \
                    self.rollout.model_fields_set:
                # Left unset: sample no longer than the learner trains on.
                self.rollout.max_new_tokens = self.data.max_target_len
            if self.rollout.max_new_tokens > self.data.max_target_len:
                raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens} exceeds data.max_target_len="
                                 f"{self.data.max_target_len}: the learner trains on the samples' tokens as they are")
            if self.rl.algorithm in ("rloo", "grpo") and self.rollout.num_samples < 2:
                raise ValueError(f"rl.algorithm={self.rl.algorithm} needs rollout.num_samples >= 2 (K samples per "
                                 "source form the baseline)")
            if self.rl.algorithm == "nlpo" and (self.rollout.backend == "ct2" or self.rollout.source == "http"):
                raise ValueError("rl.algorithm=nlpo samples with a masking policy: use rollout.backend=torch and "
                                 "rollout.source=ray")
        if self.rollout.backend == "ct2" and self.rollout.top_p < 1.0:
            raise ValueError("rollout.top_p: the ct2 rollout backend has no nucleus sampling (leave it at 1)")
        _check_precision(self.model, self.run.mixed_precision)
        if self.rollout.source == "http" and not self.rollout.urls:
            raise ValueError("rollout.source=http needs rollout.urls (policy server base URLs)")
        if self.reward.source == "http" and not self.reward.url:
            raise ValueError("reward.source=http needs reward.url (the reward server's base URL)")
        if self.predict.num_hypotheses > self.predict.beam_size:
            raise ValueError(f"predict.num_hypotheses={self.predict.num_hypotheses} exceeds predict.beam_size="
                             f"{self.predict.beam_size}")
        if self.eval.max_new_tokens > self.data.max_target_len * 4:
            if "max_new_tokens" not in self.eval.model_fields_set:  # left unset: follows short targets down
                self.eval.max_new_tokens = self.data.max_target_len * 4
                self.eval.model_fields_set.discard("max_new_tokens")
            else:
                raise ValueError(f"eval.max_new_tokens={self.eval.max_new_tokens} is more than 4x data.max_target_len="
                                 f"{self.data.max_target_len}; likely a typo")
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


def _check_precision(model: ModelConfig, mixed_precision: str) -> None:
    """fp16 refused for families that overflow in it, before anything runs (the family of model.path is read
    from its config.json when readable; load_policy's callers check again on what they actually load)."""
    if mixed_precision != "fp16":
        return
    if model.path is None:
        check_mixed_precision(model.family, mixed_precision)
        return
    try:
        found = json.loads((Path(model.path) / "config.json").read_text())
        family_of(found)
    except (OSError, ValueError):
        return  # not readable or not a known family: load_policy says so with the full story
    check_mixed_precision(found, mixed_precision)


class _ConfigLoader(yaml.SafeLoader):
    """YAML as configs are written: ``1e-4`` is a number (YAML 1.1 reads a float without a dot as a string),
    and a key given twice in one mapping is an error (YAML keeps the last, silently dropping the first
    block's settings)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise ConfigError(f"line {line}: key {key!r} given twice in one mapping "
                                  f"(first on line {seen[key]}); merge the two")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader)


def _parse_value(text: str) -> Any:
    """`a.b=value` values are YAML scalars: 3, 0.5, 1e-4, true, null, [1, 2], "text"."""
    try:
        return _yaml(text) if text != "" else ""
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


def shipped_configs() -> dict[str, Path]:
    """The example configs that ship with rlt2t (``configs/*.yaml`` of the source tree), by name."""
    from importlib.resources import files

    try:
        folder = files("rlt2t.configs")
    except ModuleNotFoundError:
        return {}
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def resolve_config_path(path: str | Path) -> Path:
    """A config file path, or the name of a shipped config (``tiny``, ``feedback``, ...)."""
    p = Path(path)
    if p.is_file():
        return p
    shipped = shipped_configs()
    if p.suffix in ("", ".yaml") and p.parent == Path(".") and p.stem in shipped:
        return shipped[p.stem]
    raise ConfigError(f"config file not found: {p} (shipped configs: {', '.join(sorted(shipped)) or 'none'})")


def load_config(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """Merge YAML files (later wins; a shipped config may be named: ``tiny``) and ``a.b=value`` overrides onto
    the defaults, then validate."""
    tree: dict[str, Any] = {}
    for path in paths:
        path = resolve_config_path(path)
        try:
            loaded = _yaml(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        _deep_merge(tree, loaded)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key.path=value")
        try:
            value = _parse_value(raw)
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        _set_dotted(tree, key.strip(), value)
    origin = ", ".join([str(p) for p in paths] + list(overrides)) or "defaults"
    problems = _retired_keys(tree) + _boolean_numbers(tree, Config)
    if problems:
        raise ConfigError(f"invalid config ({origin}):\n  " + "\n  ".join(problems))
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


def explain(model: type[BaseModel] = Config, prefix: str = "", width: int = 100) -> list[str]:
    """Every key with its default and its whole description (wrapped), for `rlt2t config --explain`."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.extend(explain(ann, f"{prefix}{name}.", width))
            continue
        default = field.get_default(call_default_factory=True)
        text = " ".join((field.description or "").split())
        lines.append(f"{prefix}{name} = {default!r}")
        lines.extend(textwrap.wrap(text, width=width, initial_indent="    ", subsequent_indent="    "))
    return lines
