"""The RL job's section `rl` (with `rl.rank`, `rl.kl`, `rl.pg` and each algorithm's own `rl.<name>`) and `rollout`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from rlt2t.common.algorithms import BUILTIN, Algorithm, algorithm, algorithm_sections
from rlt2t.common.config.base import ComputeType, _Section
from rlt2t.common.config.model import StageConfig
from rlt2t.common.types import RolloutSpec


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


class FSDPConfig(_Section):
    """The sharded learner (rl.strategy=fsdp): PyTorch's FSDP2 (``fully_shard``) over the learner ranks, one
    unit per encoder and decoder layer plus the rest of the model (docs/guides/cluster.md, "Models that do not
    fit one GPU")."""

    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward and gather them again for the backward (ZeRO-3's
    memory); false keeps them from forward to backward (ZeRO-2's: less communication, more memory)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward instead of keeping them (less memory, about a third
    more compute)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory, moved to the GPU per layer
    (CUDA only: ignored, with a warning, by a learner on the CPU)."""


class RLConfig(StageConfig):
    """The RL job on Ray: rollout and reward actors feeding a DDP learner group (`rlt2t train`)."""

    algorithm: str = "grpo"
    """The RL algorithm: a registered name, or the `package.module:Class` path of a unit of your own
    (docs/reference/algorithms.md describes each registered one; docs/design.md defines them). `grpo`, the
    default, gave the benchmark's most consistent gain over continued SFT."""
    epochs: int = Field(1, ge=1)
    """Passes over the training sources."""
    lr: float = Field(2e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of steps of linear warmup."""
    batch_size: int = Field(16, ge=1)
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
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How the learner ranks hold the policy: `ddp`, every rank a whole copy of the weights, gradients and
    AdamW's moments (about 16 bytes a parameter in fp32); `fsdp`, each rank 1/rl.learners of them (FSDP2),
    gathered layer by layer for the forward and backward, for models that do not fit one GPU (rl.fsdp.*).
    Under `fsdp` with run.mixed_precision=bf16 the parameters compute in bf16 and the gradients reduce in fp32.
    Checkpoints hold the whole model either way (a Hugging Face directory) and each rank's optimizer shard."""
    fsdp: FSDPConfig = FSDPConfig()
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
    preflight: bool | None = None
    """Each learner rank runs one forward/backward on the largest batch it can receive (rl.batch_size /
    learners sources, data.max_source_len / max_target_len tokens) while the workers start: out-of-memory
    fails the job at setup, and the first step does not pay the fresh process's warm-up. No optimizer step,
    RNGs restored: training is unchanged. null: on when the learner ranks have GPUs (rl.learner_gpus > 0), whose
    memory is what runs out; off on CPU, where the pass competes with the starting workers for the cores (on
    the 2-core demo it added about 5 s)."""

    @property
    def runs_preflight(self) -> bool:
        """``preflight`` resolved: explicit, else on for GPU learner ranks."""
        return self.preflight if self.preflight is not None else self.learner_gpus > 0

    _sections: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _algorithm_sections(cls, data: Any, handler: Any) -> RLConfig:
        """``rl.<name>``: the settings section of algorithm ``name``, validated by its unit's model (any
        registered algorithm's, and the chosen one's when it is a unit of one's own). A unit's model that leaves
        `extra` unset still refuses unknown keys (a typo would pass silently); `extra="allow"` keeps them."""
        sections: dict[str, BaseModel] = {}
        if isinstance(data, dict):
            data = dict(data)
            known = algorithm_sections(data.get("algorithm", cls.model_fields["algorithm"].default))
            for key in [k for k in data if k not in cls.model_fields and k in known]:
                raw, model = data.pop(key), known[key]
                # a unit of one's own may leave its model's extra keys allowed: a typo must not pass silently
                names = {n for name, f in model.model_fields.items()
                         for n in (name, f.alias, f.validation_alias) if isinstance(n, str)}
                unknown = ([k for k in raw if k not in names] if isinstance(raw, dict)
                           and model.model_config.get("extra") is None else [])
                try:
                    if unknown:
                        raise ValidationError.from_exception_data(model.__name__, [
                            {"type": "extra_forbidden", "loc": (k,), "input": raw[k]} for k in unknown])
                    sections[key] = raw if isinstance(raw, model) else model.model_validate(raw)
                except ValidationError as e:
                    raise ValidationError.from_exception_data(cls.__name__, [
                        {"type": err["type"], "loc": (key, *err["loc"]), "input": err["input"],
                         "ctx": err.get("ctx", {})} for err in e.errors()]) from None
        rl = handler(data)
        if sections:
            rl._sections.update(sections)
        return rl

    @model_serializer(mode="wrap")
    def _dump_sections(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key, section in self._sections.items():
            out[key] = section.model_dump(mode="json")
        return out

    @property
    def unused_sections(self) -> list[str]:
        """The settings sections given (``rl.<name>``) of algorithms other than ``rl.algorithm``: they do nothing
        in this run (``rl.dpo``'s preference files with ``rl.algorithm=grpo``, say)."""
        return sorted(k for k in self._sections if k != self.unit.name)

    def section(self, name: str | None = None) -> Any:
        """The settings section ``rl.<name>`` of an algorithm (the chosen one's by default): as given, or its
        defaults. None for an algorithm without one."""
        unit = self.unit if name is None else algorithm(name)
        if unit.settings is None:
            return None
        return self._sections.get(unit.name) or unit.settings()

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, value: str) -> str:
        unit = algorithm(value)  # a ValueError naming the registered ones when it is none of them
        if value not in BUILTIN and unit.name in cls.model_fields:  # (rank RL's section is the field rl.rank)
            raise ValueError(f"rl.algorithm: {value!r} is named {unit.name!r}, a key of the rl section (its settings "
                             f"section rl.{unit.name} could not be set); choose another `name`")
        return value

    @model_validator(mode="after")
    def _algorithm_rules(self) -> RLConfig:
        self.unit.check_rl(self)
        return self

    @property
    def unit(self) -> Algorithm:
        """The algorithm's unit (``rlt2t.common.algorithms``): what it asks of the rollouts and the learner."""
        return algorithm(self.algorithm)

    @property
    def refresh_interval(self) -> int:
        """``refresh_every_steps`` resolved: the algorithm's default when unset (0, per epoch, for rank RL; 1 for
        the policy gradients)."""
        if self.refresh_every_steps is not None:
            return self.refresh_every_steps
        return self.unit.default_refresh_steps

    @property
    def uses_kl(self) -> bool:
        """Whether the algorithm's loss or reward has a KL to the reference (rank RL has none)."""
        return self.unit.uses_reference and self.kl.coef > 0

    @property
    def rollout_spec(self) -> RolloutSpec:
        """What the rollout workers return for the algorithm."""
        return self.unit.rollout_spec(self)

    @property
    def mask_refresh_steps(self) -> int:
        """Learner steps between refreshes of the masking policy the rollouts sample inside (NLPO); 0: no mask."""
        return self.unit.mask_refresh_steps(self)

    @property
    def samples_groups(self) -> bool:
        """Whether the rollouts sample rollout.num_samples candidates per source for the learner."""
        return self.unit.data == "groups"

    @property
    def optimisation_epochs(self) -> int:
        return self.unit.optimisation_epochs(self)

    @property
    def optimisation_minibatches(self) -> int:
        return self.unit.optimisation_minibatches(self)


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
    num_samples: int = Field(12, ge=1)
    """K: candidates sampled per source (rank RL adds the gold target to them). The group policy gradients
    compare a source's samples with each other: more of them, the fewer groups without a reward spread."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely next tokens (0: the whole vocabulary, sampling the policy itself, what the
    policy gradients want; the original rank RL used 3)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the most likely tokens whose mass reaches p (1: off), after the temperature and top-k."""
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
    ct2_compute_type: ComputeType = "int8"
    """CTranslate2 compute type of the `ct2` backend (int8, int8_float32, float32, ...)."""
