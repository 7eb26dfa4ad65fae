"""The whole tree (:class:`Config`) and the rules across its sections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import (
    PrivateAttr,
    model_validator,
)

from rlt2t.common.config.base import _Section
from rlt2t.common.config.evaluation import EvalConfig, MetricConfig
from rlt2t.common.config.model import (
    DataConfig,
    ModelConfig,
    PretrainConfig,
    RunConfig,
    SFTConfig,
    SynthConfig,
    TokenizerConfig,
)
from rlt2t.common.config.reward import ClassifierConfig, FeedbackConfig, RewardConfig, RewardModelConfig
from rlt2t.common.config.rl import RLConfig, RolloutConfig
from rlt2t.common.config.services import AnnotateConfig, ExportConfig, PredictConfig, ServeConfig
from rlt2t.common.family_table import (
    FAMILIES,
    PRESETS,
    TOKENIZER_FILES,
    check_mixed_precision,
    family_of,
    has_tokenizer,
)

# The cross-section rules that change a value the user left unset: (key, rule). `rlt2t config --explain` lists
# them; a loaded config says which it applied (Config.derived, logged by load_config, commented by `rlt2t config`).
DERIVED_VALUES: tuple[tuple[str, str], ...] = (
    ("rl.chunk_size", "when it does not divide rl.batch_size: the largest divisor of rl.batch_size up to it"),
    ("rollout.max_new_tokens", "for an algorithm that samples groups, when above data.max_target_len: lowered "
     "to it (the learner trains on the samples' tokens as they are)"),
    ("eval.max_new_tokens", "when above 4 x data.max_target_len: lowered to it"),
    ("reward.bleu_weight, reward.cider_sigma", "follow metric.bleu_weight and metric.cider_sigma"),
    ("rl.lr", "the algorithm's own default where its unit declares one (docs/reference/algorithms.md)"),
)


MONITOR_OVER_HTTP = ("metric.monitor=reward scores reward.terms in the job, and with reward.source=http the reward is "
                     "the server's: name a metric instead (task_score is what a reward server scores)")
"""Why a reward monitor and a reward server do not go together (said by the config, and by a job whose config
was changed after it loaded: assigning a section's field does not run this cross-section check)."""


class Config(_Section):
    _derived: list[str] = PrivateAttr(default_factory=list)

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

    def _note(self, key: str, old: Any, new: Any, why: str) -> None:
        self._derived.append(f"{key}: {new!r}, not its default {old!r} ({why})")

    @property
    def derived(self) -> list[str]:
        """The values a cross-section rule set (DERIVED_VALUES) for keys left unset, one line each."""
        return list(self._derived)

    @model_validator(mode="after")
    def _reward_follows_metric(self) -> Config:
        # The rewards optimise the metric the run is judged on, unless told otherwise.
        for key in ("bleu_weight", "cider_sigma"):
            if key not in self.reward.model_fields_set:
                if getattr(self.reward, key) != getattr(self.metric, key):
                    self._note(f"reward.{key}", getattr(self.reward, key), getattr(self.metric, key),
                               f"follows metric.{key}")
                setattr(self.reward, key, getattr(self.metric, key))
                self.reward.model_fields_set.discard(key)  # still unset: follows metric.* again on another load
        return self

    @model_validator(mode="after")
    def _algorithm_learning_rate(self) -> Config:
        # An algorithm whose step is of another scale than the policy gradients' brings its own rl.lr default.
        lr = self.rl.unit.default_lr
        if lr is not None and "lr" not in self.rl.model_fields_set and self.rl.lr != lr:
            self._note("rl.lr", self.rl.lr, lr, f"rl.algorithm={self.rl.algorithm}'s own default")
            self.rl.lr = lr
            self.rl.model_fields_set.discard("lr")  # still unset: another algorithm gets its own default again
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
            chunk = max(d for d in range(1, self.rl.chunk_size + 1) if self.rl.batch_size % d == 0)
            if self.rl.batch_size != type(self.rl).model_fields["batch_size"].default:  # the defaults' pair (the
                # default batch, set or not: configs/tiny.yaml writes it out) is not news: no note for it
                self._note("rl.chunk_size", self.rl.chunk_size, chunk,
                           f"the largest divisor of rl.batch_size={self.rl.batch_size} up to it")
            self.rl.chunk_size = chunk
            self.rl.model_fields_set.discard("chunk_size")  # still unset: derived again for another batch size
        if self.rl.samples_groups:
            if self.rollout.max_new_tokens > self.data.max_target_len and "max_new_tokens" not in \
                    self.rollout.model_fields_set:
                # Left unset: sample no longer than the learner trains on.
                self._note("rollout.max_new_tokens", self.rollout.max_new_tokens, self.data.max_target_len,
                           "data.max_target_len")
                self.rollout.max_new_tokens = self.data.max_target_len
            if self.rollout.max_new_tokens > self.data.max_target_len:
                raise ValueError(f"rollout.max_new_tokens={self.rollout.max_new_tokens} exceeds data.max_target_len="
                                 f"{self.data.max_target_len}: the learner trains on the samples' tokens as they are")
        self.rl.unit.check(self)
        _check_precision(self.model, self.run.mixed_precision)
        _check_model_tokenizer(self.model, self.tokenizer)
        if self.rl.strategy == "fsdp":
            _check_sharded(self)
        _check_stage_ranks(self)
        if self.rollout.source == "http" and not self.rollout.urls:
            raise ValueError("rollout.source=http needs rollout.urls (policy server base URLs)")
        if self.reward.source == "http" and not self.reward.url:
            raise ValueError("reward.source=http needs reward.url (the reward server's base URL)")
        if self.reward.source == "http" and self.metric.monitor == "reward":
            raise ValueError(MONITOR_OVER_HTTP)
        if self.predict.num_hypotheses > self.predict.beam_size:
            raise ValueError(f"predict.num_hypotheses={self.predict.num_hypotheses} exceeds predict.beam_size="
                             f"{self.predict.beam_size}")
        if self.eval.max_new_tokens > self.data.max_target_len * 4:
            if "max_new_tokens" not in self.eval.model_fields_set:  # left unset: follows short targets down
                self._note("eval.max_new_tokens", self.eval.max_new_tokens, self.data.max_target_len * 4,
                           "4 x data.max_target_len")
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


def _check_sharded(cfg: Config) -> None:
    """What rl.strategy=fsdp does not cover yet, refused before anything runs (each with the key to change)."""
    why = None
    if not cfg.rl.unit.shardable:
        why = f"rl.algorithm={cfg.rl.algorithm} has no sharded learner (its unit is not shardable)"
    elif cfg.run.mixed_precision == "fp16":
        why = "run.mixed_precision=fp16 needs a sharded loss scaler; use bf16"
    if why:
        raise ValueError(f"rl.strategy=fsdp: {why}. Use rl.strategy=ddp for this run.")


def _check_stage_ranks(cfg: Config) -> None:
    """What the pretraining and SFT stages on several ranks (``strategy`` ddp / fsdp) do not cover yet."""
    for name, stage in (("pretrain", cfg.pretrain), ("sft", cfg.sft)):
        if stage.strategy != "fsdp":
            continue
        why = None
        if cfg.run.mixed_precision == "fp16":
            why = "run.mixed_precision=fp16 needs a sharded loss scaler; use bf16"
        elif name == "sft" and cfg.sft.fgm_epsilon > 0:
            why = "sft.fgm_epsilon: FGM perturbs the whole input embedding, which is sharded; set it to 0"
        if why:
            raise ValueError(f"{name}.strategy=fsdp: {why}. Use {name}.strategy=ddp for this run.")


def _check_model_tokenizer(model: ModelConfig, tokenizer: TokenizerConfig) -> None:
    """A model directory without its tokenizer's files is refused unless tokenizer.path names one: the tokenizer
    would otherwise be the run's own ``{run}/tokenizer`` (built by `rlt2t tokenizer build`, or copied there by an
    earlier stage), which a pretrained model was not trained with, and a smaller one trains without an error.
    (A directory that does not exist yet, or an adapter checkpoint, has no config.json: load_policy checks it.)"""
    if model.path is None or tokenizer.path is not None:
        return
    path = Path(model.path)
    if (path / "config.json").is_file() and not has_tokenizer(path):
        raise ValueError(
            f"model.path={model.path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): a pretrained model "
            "needs the tokenizer it was trained with, and the run's own {run}/tokenizer is not "
            f"it. Save that tokenizer into the directory (tokenizer.save_pretrained({str(path)!r})), or name its "
            "directory with tokenizer.path=DIR")


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
