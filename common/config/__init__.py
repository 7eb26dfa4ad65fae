"""The one typed config tree, one module per group of sections.

Defaults here *are* the embedded default run (`make demo`): local, CPU, synthetic data, the `small`
preset. YAML files in ``configs/`` override them, and ``a.b=value`` arguments override the YAML.
Unknown keys, wrong types and impossible values fail with a message naming the key
(``sft.lr: must be > 0``). Each component receives only its own sub-config.

- :mod:`.base`: the section base class and :class:`ConfigError`;
- :mod:`.model`: `run`, `synth`, `data`, `tokenizer`, `model`, `pretrain`, `sft`;
- :mod:`.rl`: `rl` (with `rl.rank`, `rl.kl`, `rl.pg` and each algorithm's own `rl.<name>`) and `rollout`;
- :mod:`.reward`: `reward` and its terms, `reward_model`, `classifier`, `feedback`;
- :mod:`.evaluation`: `eval`, `metric`; :mod:`.services`: `serve`, `export`, `predict`, `annotate`;
- :mod:`.root`: :class:`Config`, the whole tree, and the rules across its sections (``DERIVED_VALUES``: the
  values they set for keys left unset);
- :mod:`.loading`: :func:`load_config`, :func:`config_to_yaml`, :func:`explain`.

Everything is importable from here, as before the split.
"""

from __future__ import annotations

from rlt2t.common.config.base import (  # noqa: F401
    ConfigError,
    did_you_mean,
    shared_directory,
)
from rlt2t.common.config.evaluation import (  # noqa: F401
    EvalConfig,
    MetricConfig,
)
from rlt2t.common.config.loading import (  # noqa: F401
    config_to_yaml,
    explain,
    explain_derived,
    load_config,
    resolve_config_path,
    shipped_configs,
)
from rlt2t.common.config.model import (  # noqa: F401
    DataConfig,
    LoraConfig,
    ModelConfig,
    PretrainConfig,
    RunConfig,
    SFTConfig,
    StageConfig,
    SynthConfig,
    TextStageConfig,
    TokenizerConfig,
)
from rlt2t.common.config.reward import (  # noqa: F401
    ClassifierConfig,
    ClassifierTerm,
    FeedbackConfig,
    HttpTerm,
    MetricTerm,
    PythonTerm,
    RewardConfig,
    RewardModelConfig,
    RewardModelTerm,
    RewardTerm,
)
from rlt2t.common.config.rl import (  # noqa: F401
    RANK_LOSS_KEYS,
    FSDPConfig,
    KLConfig,
    PolicyGradientConfig,
    RankLossConfig,
    RLConfig,
    RolloutConfig,
)
from rlt2t.common.config.root import (  # noqa: F401
    DERIVED_VALUES,
    MONITOR_OVER_HTTP,
    Config,
)
from rlt2t.common.config.services import (  # noqa: F401
    AnnotateConfig,
    ExportConfig,
    PredictConfig,
    ServeConfig,
)

__all__ = [
    "AnnotateConfig",
    "ClassifierConfig",
    "ClassifierTerm",
    "Config",
    "ConfigError",
    "did_you_mean",
    "DERIVED_VALUES",
    "DataConfig",
    "EvalConfig",
    "ExportConfig",
    "FSDPConfig",
    "FeedbackConfig",
    "HttpTerm",
    "KLConfig",
    "LoraConfig",
    "MetricConfig",
    "MetricTerm",
    "ModelConfig",
    "PolicyGradientConfig",
    "PredictConfig",
    "PretrainConfig",
    "PythonTerm",
    "RANK_LOSS_KEYS",
    "RLConfig",
    "RankLossConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelTerm",
    "RewardTerm",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "ServeConfig",
    "StageConfig",
    "SynthConfig",
    "TextStageConfig",
    "TokenizerConfig",
    "config_to_yaml",
    "explain",
    "explain_derived",
    "load_config",
    "resolve_config_path",
    "shared_directory",
    "shipped_configs",
]
