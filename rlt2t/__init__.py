"""rlt2t: RL fine-tuning of encoder-decoder text-to-text models on Ray.

The public API (docs/reference/api.md): the stages of a run as functions of one config (:mod:`rlt2t.api`), the
registries of metrics and rewards, the HTTP clients and the config types, all importable from here:

    import rlt2t
    cfg = rlt2t.load_config("tiny", overrides={"run.dir": "runs/mine"})
    rlt2t.train(cfg, reward=my_reward)

Names load on first use (PEP 562), so ``import rlt2t`` imports neither torch nor Ray.
"""

from __future__ import annotations

import importlib
import os.path

# In a source checkout the subpackages sit beside this folder (common/, learner/, actors/, services/, configs/;
# pyproject maps them in). The editable install's finder maps them to *its* checkout, so a copy of a checkout
# imported from its own root (a Ray job's uploaded working directory, a second clone as the working directory of
# `python -m rlt2t.cli`) would run this folder's modules with the install's subpackages. Its root joins the
# package path, ahead of that finder: the copy runs whole. An installed wheel (no pyproject.toml) is unaffected.
_root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if os.path.isfile(os.path.join(_root, "pyproject.toml")) and os.path.isdir(os.path.join(_root, "common")):
    __path__.append(_root)
del _root

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a few ms of every `import rlt2t`)
if TYPE_CHECKING:
    from typing import Any

    from rlt2t.api import (
        build_tokenizer,
        demo,
        evaluate,
        export,
        import_data,
        load_config,
        predict,
        pretrain,
        sft,
        synth_data,
        train,
    )
    from rlt2t.common.config import ClassifierTerm, Config, HttpTerm, MetricTerm, PythonTerm, RewardModelTerm
    from rlt2t.common.metrics import register_metric
    from rlt2t.common.python_rewards import register_reward
    from rlt2t.services.client import AsyncPolicyClient, AsyncRewardClient, PolicyClient, RewardClient

__all__ = ["load_config", "import_data", "synth_data", "build_tokenizer", "pretrain", "sft", "train", "evaluate",
           "export", "predict", "demo", "Config", "PythonTerm", "MetricTerm", "RewardModelTerm", "ClassifierTerm",
           "HttpTerm", "register_metric", "register_reward", "PolicyClient", "RewardClient", "AsyncPolicyClient",
           "AsyncRewardClient"]

# Where each name lives: imported when first asked for.
_HOMES = {
    **dict.fromkeys(("build_tokenizer", "demo", "evaluate", "export", "import_data", "load_config", "predict",
                     "pretrain", "sft", "synth_data", "train"), "rlt2t.api"),
    "Config": "rlt2t.common.config",
    **dict.fromkeys(("PythonTerm", "MetricTerm", "RewardModelTerm", "ClassifierTerm", "HttpTerm"),
                    "rlt2t.common.config"),
    "register_metric": "rlt2t.common.metrics",
    "register_reward": "rlt2t.common.python_rewards",
    **dict.fromkeys(("PolicyClient", "RewardClient", "AsyncPolicyClient", "AsyncRewardClient"),
                    "rlt2t.services.client"),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rlt2t' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
