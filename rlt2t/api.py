"""The Python API: every stage of a run as a function of one config, what the `rlt2t` commands call.

    import rlt2t

    def brevity(sources, candidates, references, **row_fields):
        return [-abs(len(c.split()) - len(refs[0].split())) for c, refs in zip(candidates, references)]

    cfg = rlt2t.load_config("tiny", overrides={"run.dir": "runs/mine", "rl.algorithm": "grpo"})
    rlt2t.synth_data(cfg)
    rlt2t.build_tokenizer(cfg)
    rlt2t.sft(cfg)
    rlt2t.train(cfg, reward=brevity)
    print(rlt2t.evaluate(cfg, ["sft", "rl"]).to_markdown())

Each function takes the whole config (``rlt2t.Config``) and writes under ``run.dir``, as the command
of the same name does. ``import rlt2t`` is instant: torch, transformers and Ray load when a function that needs
them runs. Besides these: ``register_metric``, ``register_reward``, ``PolicyClient``, ``RewardClient`` (and their
async twins), ``Config`` and the reward terms (``PythonTerm``, ``MetricTerm``, ``RewardModelTerm``,
``ClassifierTerm``, ``HttpTerm``), all importable from ``rlt2t``.

Progress and warnings are logged as the commands print them, on stderr, unless your program has configured
logging before the first call (any handler on the root logger): then they go where you sent them.
"""

from __future__ import annotations

import json
import logging
import sys
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from rlt2t.common import config as _config
from rlt2t.common.config import Config, PythonTerm, RewardTerm

if TYPE_CHECKING:
    from rlt2t.demo_pipeline import DemoResult
    from rlt2t.driver import TrainResult
    from rlt2t.ensemble import PredictResult
    from rlt2t.eval_table import EvalTable
    from rlt2t.learner.trainer import StageResult

# In the order of a run (the reference page lists them so).
__all__ = ["load_config", "import_data", "synth_data", "build_tokenizer", "pretrain", "sft", "train", "evaluate",
           "export", "predict", "demo"]

log = logging.getLogger("rlt2t.api")

PathLike = str | Path


def _show_progress() -> None:
    """The job's progress lines on stderr, as the commands print them, unless the program has set up logging
    itself (a handler on the root logger, e.g. ``logging.basicConfig``): otherwise a script that calls
    ``rlt2t.sft(cfg)`` sees nothing, not even a warning, until it returns."""
    if not logging.getLogger().handlers:
        from rlt2t.common.tracking import setup_logging

        setup_logging()


def _override_strings(overrides: Mapping[str, Any], prefix: str = "") -> list[str]:
    """A dict of sections (``{"rl": {"lr": 1e-4}}``) or dotted keys (``{"rl.lr": 1e-4}``) as ``key.path=value``
    strings, each value written as JSON (which the config reads as YAML)."""
    out = []
    for key, value in overrides.items():
        if isinstance(value, Mapping) and value:
            out += _override_strings(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value, default=str)}")
    return out


def load_config(*files: PathLike, overrides: Sequence[str] | Mapping[str, Any] = ()) -> Config:
    """The config tree: the defaults, then each YAML file in order (a path, or the name of a shipped config such
    as ``"tiny"``), then ``overrides``: ``"key.path=value"`` strings, or a dict of sections or dotted keys.
    Unknown keys and bad values raise ``ConfigError`` (a ``ValueError``) naming the key.

        cfg = rlt2t.load_config("tiny", overrides={"run": {"dir": "runs/mine"}, "rl.algorithm": "grpo"})
        cfg = rlt2t.load_config("configs/tiny.yaml", overrides=["sft.lr=3e-4"])
    """
    if isinstance(overrides, str):
        raise TypeError("overrides: a list of 'key.path=value' strings or a dict, not one string")
    strings = _override_strings(overrides) if isinstance(overrides, Mapping) else list(overrides)
    return _config.load_config(list(files), strings)


def import_data(cfg: Config, input: PathLike, out: PathLike | None = None, *, valid_fraction: float | None = None,
                test_fraction: float | None = None, unlabeled: bool = False, force: bool = False,
                competition_csv: bool = False) -> dict[str, Path]:
    """Split one data file of any format (read with the config's column mapping, ``data.source_field`` ...) into
    train / valid / test JSONL under ``out`` (default data.train's directory, where the stages read them), by
    ``valid_fraction`` (0.05) and ``test_fraction`` (0) with ``run.seed``; ``unlabeled``: its rows as test.jsonl
    inputs alone; ``competition_csv``: the competition's header-less CSV (`rlt2t data import`, `data import-csv`).
    The files keep the mapping's column names, so the same config reads them. Returns split → file written; split
    files already there raise FileExistsError unless ``force``.

        files = rlt2t.import_data(cfg, "pairs.csv", test_fraction=0.1)   # {"train": ..., "valid": ..., "test": ...}
    """
    from rlt2t.data_import import import_data as run_import

    return run_import(cfg, input, out, valid_fraction=valid_fraction, test_fraction=test_fraction,
                      unlabeled=unlabeled, force=force, competition_csv=competition_csv, report=log.info)


def synth_data(cfg: Config, *, fmt: Literal["jsonl", "csv"] = "jsonl", force: bool = False) -> dict[str, Path]:
    """Write the synthetic report task (``synth.*``) into data.train's directory; returns split → file
    (`rlt2t data synth`). The same task already there (same ``synth.*`` settings) is kept as it is; other split
    files there raise FileExistsError unless ``force`` replaces them.

        files = rlt2t.synth_data(cfg)       # {"train": Path(".../train.jsonl"), "valid": ..., "test": ...}
    """
    _show_progress()
    from rlt2t.jobs import check_task_out, make_synthetic_data, synthetic_data_in_place

    kept = None if force else synthetic_data_in_place(cfg, fmt)
    if kept is not None:
        log.info("synthetic data (%d rows, seed %d) already in %s: kept", cfg.synth.size, cfg.synth.seed,
                 kept["train"].parent)
        return kept
    check_task_out(cfg, fmt, force)
    return make_synthetic_data(cfg, fmt=fmt)


def build_tokenizer(cfg: Config, *, force: bool = False) -> Path:
    """Build (``ids``), train (``subword``) or copy (``pretrained``) the tokenizer per ``tokenizer.kind``; returns
    its directory (`rlt2t tokenizer build`). The run's tokenizer already there is kept when these settings build
    the same one (a script run again), and replaced by another only with ``force``.

        rlt2t.build_tokenizer(cfg)
    """
    _show_progress()
    from rlt2t.jobs import build_tokenizer_job

    return build_tokenizer_job(cfg, force=force)


def pretrain(cfg: Config, *, resume: bool = False, init: PathLike | None = None) -> StageResult:
    """Denoising pretraining (span corruption, ``pretrain.objective``) into ``{run}/pretrain`` (`rlt2t pretrain`);
    ``init`` is a model directory or checkpoint root (its best, else its newest) to start from, ``resume`` continues
    the stage's newest checkpoint. ``result.checkpoint`` is the stage's last checkpoint, ``result.best`` the one its
    validation monitor picked.

        result = rlt2t.pretrain(cfg)
        print(result.checkpoint, result.steps)
    """
    _show_progress()
    from rlt2t.jobs import pretrain_job

    return pretrain_job(cfg, resume=resume, init=init)


def sft(cfg: Config, *, resume: bool = False, init: PathLike | None = None) -> StageResult:
    """Supervised fine-tuning into ``{run}/sft`` (`rlt2t sft`), from ``init`` or the run's pretraining.

        result = rlt2t.sft(cfg, init="models/my-bart")   # a local pretrained model directory
    """
    _show_progress()
    from rlt2t.jobs import sft_job

    return sft_job(cfg, resume=resume, init=init)


RewardSpec = Callable[..., Any] | RewardTerm | str
"""A reward given to ``train``: a function (a Python term of weight 1), a term (``PythonTerm(fn=f,
weight=0.5)``, ``MetricTerm(name="bleu4")``, ...) or a ``package.module:function`` path."""


def train(cfg: Config, *, reward: RewardSpec | Sequence[RewardSpec] | None = None, resume: bool = False,
          init: PathLike | None = None) -> TrainResult:
    """RL on Ray (``rl.algorithm``) into ``{run}/rl`` from the run's best SFT checkpoint or ``init``
    (`rlt2t train`). ``reward`` replaces ``reward.terms``: a function, a term, or a list of them (summed with
    their weights). A function is batched, ``fn(sources, candidates, references, **row_fields) -> floats``
    (``PythonTerm(fn=f, per_sample=True)`` for one of a single candidate); it reaches the Ray reward workers with
    the config, by value when defined in ``__main__`` or outside the installed packages. The metrics and rewards
    the reward names that this process registered reach them too. With a reward that reads no references, the
    training rows need only a source (``references`` then holds empty lists; ``rlt2t.jobs.rl_splits``).

        def shorter(sources, candidates, references, **row_fields):
            return [-len(c.split()) for c in candidates]

        result = rlt2t.train(cfg, reward=[shorter, rlt2t.PythonTerm(fn="mypkg.rewards:style", weight=0.1)])
    """
    _show_progress()
    from rlt2t.common.rewards import UserRegistrations, check_reward
    from rlt2t.jobs import rl_job

    if reward is not None:
        if cfg.reward.source == "http":
            raise ValueError("reward: reward.source=http scores on the reward server at reward.url, which would "
                             "ignore this reward; serve it there (reward.named) or set reward.source=ray")
        cfg = _with_reward(cfg, reward)
    if cfg.reward.source != "http":
        check_reward(cfg.reward)  # before a checkpoint loads: a function that does not import fails at once
    registered = UserRegistrations.used_by(cfg.reward)
    for fn in [*registered.metrics.values(), *registered.rewards.values(),
               *(t.fn for t in cfg.reward.terms if isinstance(t, PythonTerm) and callable(t.fn))]:
        _pickle_by_value_unless_installed(fn)
    return rl_job(cfg, resume=resume, init=init)


def _with_reward(cfg: Config, reward: RewardSpec | Sequence[RewardSpec]) -> Config:
    specs = [reward] if callable(reward) or isinstance(reward, str | BaseModel) else list(reward)
    if not specs:
        raise ValueError("reward: give at least one function or term")
    terms: list[RewardTerm] = [s if isinstance(s, BaseModel) else PythonTerm(fn=s) for s in specs]
    cfg = cfg.model_copy(deep=True)
    cfg.reward.terms = terms  # validated on assignment: a wrong kind of term fails naming reward.terms
    return cfg


def _pickle_by_value_unless_installed(fn: Callable[..., Any]) -> None:
    """Ship ``fn``'s module to the Ray workers by value when it is user code (not ``__main__``, which cloudpickle
    ships by value anyway, nor rlt2t or an installed package): a worker could not import a module that this
    process found on a path of its own."""
    name = getattr(fn, "__module__", None) or getattr(getattr(fn, "func", None), "__module__", None)
    module = sys.modules.get(name or "")
    if module is None or module.__name__ == "__main__" or module.__name__.partition(".")[0] == "rlt2t":
        return
    file = getattr(module, "__file__", None)
    installed = [Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib", "stdlib", "platstdlib")]
    if file is None or any(Path(file).resolve().is_relative_to(root) for root in installed):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    log.debug("rl: functions of %s (%s) travel to the workers by value", module.__name__, file)


def evaluate(cfg: Config, models: Sequence[str] | Mapping[str, PathLike] = (), *, split: str | None = None,
             metrics: Sequence[str] | str | None = None, rerank: str | None = None,
             reward: RewardSpec | Sequence[RewardSpec] | None = None) -> EvalTable:
    """Decode a split (default ``eval.split``) with each model and score it: one row per model, one column per
    metric (default ``eval.metrics``; ``"all"`` for every one). ``models``: stage names of the run (``sft``,
    ``rl``, ``pretrain``), model directories or checkpoints, ``label=path`` strings, or a dict label → path;
    none: the run's sft and rl stages (`rlt2t eval`). ``rerank`` (default ``eval.rerank``, ``none``: decode with
    ``eval.num_beams``) picks from a pool each model generates and scores, as ``predict`` does (``mbr``: minimum Bayes
    risk, ``reward``, ...). The column ``reward`` is the mean of the run's reward (``reward.terms``) over each model's
    outputs, as RL scored its samples; ``reward`` (as ``train`` takes it: a function, a term or a list) replaces
    ``reward.terms`` and adds that column. Each model's scores and predictions are saved under ``{run}/eval``;
    ``table.save(dir)`` writes the table.

        table = rlt2t.evaluate(cfg, ["sft", "rl"], metrics=["task_score", "rougeL"], reward=concise)
        print(table.to_markdown())
    """
    _show_progress()
    from rlt2t.common.plugins import load_plugins
    from rlt2t.eval_table import eval_table, resolve_metric_names, resolve_models
    from rlt2t.learner.evaluate import REWARD_COLUMN

    if reward is not None:
        cfg = _with_reward(cfg, reward)
    load_plugins(cfg.reward.plugins)  # metrics of your own
    if reward is not None:
        names = resolve_metric_names(cfg, metrics)
        metrics = names if REWARD_COLUMN in names else [*names, REWARD_COLUMN]
    chosen: dict[str, PathLike] = dict(models) if isinstance(models, Mapping) else dict(resolve_models(cfg, models))
    return eval_table(cfg, chosen, split=split, metrics=metrics, rerank=rerank)


def export(cfg: Config, checkpoint: PathLike, out: PathLike | None = None, *, quantization: str | None = None,
           force: bool = False) -> Path:
    """Convert a model directory, checkpoint or checkpoint root (its best, else its newest) to CTranslate2
    (``export.quantization`` by default) with the IDF table predict's reranker needs; returns the export directory
    (`rlt2t export`).

        ct2_dir = rlt2t.export(cfg, "runs/mine/rl/checkpoints")
    """
    _show_progress()
    from rlt2t.jobs import export_job

    return export_job(cfg, checkpoint, out, quantization=quantization, force=force)


def predict(cfg: Config, generators: Sequence[PathLike], scorers: Sequence[PathLike], input: PathLike,
            out: PathLike, *, rerank: str | None = None, metrics: Sequence[str] | None = None) -> PredictResult:
    """Ensemble inference (`rlt2t predict`): the generators propose beam hypotheses, the scorers score them, the
    reranker (``predict.rerank``, or ``rerank``: ``mean_logprob``, ``idf``, ``consensus``, ``reward`` for
    ``reward.terms`` without references, or ``mbr``: minimum Bayes risk with ``predict.mbr_utility``) picks one per
    input of ``input`` (JSONL or competition CSV) from the pool (``predict.pool``: beams, samples or both). Writes the
    submission CSV ``out`` and the candidates JSONL beside it. Inputs with targets also get a table (each
    generator alone, the ensemble, the oracle) of ``metrics`` (default ``eval.metrics``).

        result = rlt2t.predict(cfg, [ct2_dir], [ct2_dir], "data/test.jsonl", "pred.csv", rerank="mbr")
    """
    _show_progress()
    from rlt2t.ensemble import predict as run_predict

    return run_predict(cfg, list(generators), list(scorers), input, out, rerank=rerank, metrics=metrics)


def demo(cfg: Config, *, fresh: bool = False, predict: bool = True) -> DemoResult:
    """The whole pipeline on ``cfg`` (`rlt2t demo`): data, tokenizer, pretraining, SFT, continued SFT, RL, the
    comparison tables, and (``predict``) the CTranslate2 export and ensemble prediction; each stage resumes or is
    skipped when done. ``fresh`` deletes the demo's earlier outputs in run.dir first.

        result = rlt2t.demo(rlt2t.load_config("tiny", overrides={"run.dir": "runs/tiny"}))
        print(result.scores)
    """
    _show_progress()
    from rlt2t.demo_pipeline import run_demo

    return run_demo(cfg, fresh=fresh, with_predict=predict)
