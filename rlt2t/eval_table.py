"""One comparison table over several models: rows = models, columns = metrics.

`rlt2t eval` and the demo print their tables through this module. Each model is evaluated by
``rlt2t.jobs.eval_job`` (decode the split, score it, write ``<label>-<split>.json`` and the predictions under
``{run}/eval/``); the table gathers the rows and saves ``{run}/eval/<name>.{csv,json,md,png}``.

Models are named by a run's stages or by paths (:func:`resolve_models`): ``sft`` is the run's best SFT
checkpoint (by the validation monitor, else the newest), ``rl`` the RL stage's (``{run}/rl/checkpoints``, or
``{run}/rank/checkpoints`` for runs made before the stage was renamed; ``rank`` is accepted for it too),
``pretrain`` the pretraining stage's; anything else is a model directory, a checkpoint or a checkpoint root
(its newest complete checkpoint), optionally labelled ``label=path``.

    from rlt2t.eval_table import eval_table, print_eval_table
    table = eval_table(cfg, {"sft": sft_ckpt, "rank RL": rl_ckpt}, metrics=["rouge1", "meteor", "perplexity"])
    print_eval_table(table)
    table.save(cfg.run_dir / "eval")
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, TextIO, cast

from rlt2t.cmd_common import print_table
from rlt2t.common.checkpoint import resolve_model_dir
from rlt2t.common.config import Config
from rlt2t.common.config.services import PredictRerank
from rlt2t.common.io import atomic_write_text
from rlt2t.common.metrics import available_metrics, check_dependencies
from rlt2t.common.plots import plot_metric_bars
from rlt2t.common.plugins import load_plugins
from rlt2t.common.search import SEARCH_CONTROLS
from rlt2t.jobs import best_or_latest, eval_job, eval_reward
from rlt2t.learner.evaluate import MODEL_METRICS, REWARD_COLUMN, check_metric_names

STAGES = ("sft", "rl", "rank", "pretrain", "continued_sft")
"""Names that stand for a run's stage in ``--checkpoint``; ``rank`` is the RL stage's former name."""
STAGE_COMMANDS = {"sft": "rlt2t sft", "rl": "rlt2t train", "rank": "rlt2t train", "pretrain": "rlt2t pretrain",
                  "continued_sft": "rlt2t demo"}
"""The command that writes each stage's checkpoints (named when a stage has none)."""


@dataclass
class EvalTable:
    """Corpus metric values of several models on one split."""

    title: str
    split: str
    columns: list[str]
    rows: dict[str, dict[str, float]]
    """model label -> metric -> value, in ``columns`` order."""
    checkpoints: dict[str, str] = field(default_factory=dict)
    """model label -> the checkpoint directory evaluated."""

    def to_markdown(self, digits: int = 4) -> str:
        """A GitHub Markdown table (values rounded to ``digits`` decimals) under the title."""
        lines = [f"**{self.title}**", "", "| model | " + " | ".join(self.columns) + " |",
                 "| --- |" + " ---: |" * len(self.columns)]
        for label, values in self.rows.items():
            lines.append(f"| {label} | " + " | ".join(f"{values[c]:.{digits}f}" for c in self.columns) + " |")
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """``model,checkpoint,<metrics...>`` with full-precision values."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["model", "checkpoint", *self.columns])
        for label, values in self.rows.items():
            writer.writerow([label, self.checkpoints.get(label, ""), *(repr(values[c]) for c in self.columns)])
        return buf.getvalue()

    def save(self, out_dir: str | Path, name: str | None = None) -> dict[str, Path]:
        """Write ``<name>.csv``, ``.json``, ``.md`` and a ``.png`` bar chart (default name ``table-<split>``)."""
        out_dir = Path(out_dir)
        stem = name or f"table-{self.split}"
        paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("csv", "json", "md", "png")}
        atomic_write_text(paths["csv"], self.to_csv())
        # Not atomic_write_json: it sorts keys, and the rows' order is the table's.
        atomic_write_text(paths["json"], json.dumps(asdict(self), indent=2) + "\n")
        atomic_write_text(paths["md"], self.to_markdown())
        plot_metric_bars(self.rows, self.columns, paths["png"], self.title)
        return paths


def print_eval_table(table: EvalTable, file: TextIO | None = None) -> None:
    """The table in the terminal (rich), one row per model."""
    print_table(table.title, table.rows, file=file)


def stage_root(cfg: Config, stage: str) -> Path:
    """The checkpoint root of a run's stage; ``rl`` (alias ``rank``) is ``{run}/rl``, or ``{run}/rank`` where only
    that one is (a run of an older version)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    if stage in ("rl", "rank"):
        rl, rank = cfg.run_dir / "rl" / "checkpoints", cfg.run_dir / "rank" / "checkpoints"
        return rank if rank.is_dir() and not rl.is_dir() else rl
    return cfg.run_dir / stage / "checkpoints"


def _default_label(path: Path) -> str:
    # A checkpoint <stage>/checkpoints/<name> reads "<stage>-<name>", as eval_job names it; a model dir its name.
    return f"{path.parent.parent.name}-{path.name}" if path.parent.name == "checkpoints" else path.name


def _check_run_dir(cfg: Config, where: str) -> None:
    """The run's stages are read under run.dir: one that does not exist (a saved config's relative run.dir, read
    from another directory) is named as such, not as a stage without checkpoints."""
    if not cfg.run_dir.is_dir():
        raise FileNotFoundError(f"{where}run.dir={cfg.run_dir} does not exist (set run.dir to the run's directory, "
                                "or pass --checkpoint with a model directory)")


def resolve_models(cfg: Config, specs: Sequence[str]) -> dict[str, Path]:
    """``--checkpoint`` values -> {label: checkpoint directory}, in order; no specs: the run's sft and rl stages
    that have checkpoints. A stage without checkpoints, a missing path or a repeated label is a clear error."""
    if not specs:
        _check_run_dir(cfg, "")
        specs = [s for s in ("sft", "rl") if stage_root(cfg, s).is_dir()]
        if not specs:
            raise FileNotFoundError(f"{cfg.run_dir}: no sft or rl checkpoints; pass --checkpoint (a stage name "
                                    f"or a model directory)")
    models: dict[str, Path] = {}
    for spec in specs:
        label, sep, target = spec.partition("=")
        if not sep:
            label, target = "", spec
        if target in STAGES:
            root = stage_root(cfg, target)
            try:
                path = best_or_latest(root)
            except FileNotFoundError:
                _check_run_dir(cfg, f"--checkpoint {target}: ")
                made_by = STAGE_COMMANDS.get(target, "")
                raise FileNotFoundError(f"--checkpoint {target}: {root} holds no complete checkpoint"
                                        + (f" (`{made_by}` writes them)" if made_by else "")) from None
            label = label or ("rl" if target == "rank" else target)
        else:
            if not Path(target).exists():
                raise FileNotFoundError(f"--checkpoint {target}: no such directory (nor a stage name: "
                                        f"{', '.join(STAGES)})")
            path = resolve_model_dir(target)
            label = label or _default_label(path)
        if label in models:
            raise ValueError(f"--checkpoint: two models labelled {label!r}; name them with label=path")
        models[label] = path
    return models


def resolve_metric_names(cfg: Config, names: Sequence[str] | str | None) -> list[str]:
    """``--metrics``: a list or comma-separated names, ``all`` (every text metric, perplexity, and the
    classifier's accuracy when eval.classifier_path is set), or None for ``eval.metrics``."""
    if names is None:
        return check_metric_names(cfg.eval.metrics)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if list(names) == ["all"]:
        names = [n for n in available_metrics() if n != "classifier_accuracy" or cfg.eval.classifier_path]
        names += list(MODEL_METRICS)
    return check_metric_names(names, "--metrics")


def _file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-") or "model"


def eval_table(cfg: Config, checkpoints: Mapping[str, str | Path], split: str | None = None,
               metrics: Sequence[str] | str | None = None, title: str | None = None,
               rerank: str | None = None) -> EvalTable:
    """Evaluate each model of ``checkpoints`` ({label: model dir, checkpoint or checkpoint root}) on ``split``
    (default eval.split) with columns ``metrics`` (default eval.metrics; see :func:`resolve_metric_names`), decoding
    as ``rerank`` says (default eval.rerank)."""
    if not checkpoints:
        raise ValueError("eval_table needs at least one model")
    cfg = cfg.model_copy(deep=True)
    if split is not None:  # validated on assignment (a pydantic config): a bad name fails naming eval.split
        cfg.eval.split = cast(Literal["train", "valid", "test"], split)
    load_plugins(cfg.reward.plugins)  # metrics of your own, before their names are read
    cfg.eval.metrics = resolve_metric_names(cfg, metrics)
    # Before any model loads: a column whose data or package is missing (meteor: WordNet) fails naming the fix.
    check_dependencies(cfg.eval.metrics, "metrics" if metrics is not None else "eval.metrics")
    if cfg.eval.classifier_path is not None:
        cfg.eval.classifier_path = str(cfg.path(cfg.eval.classifier_path))
    if rerank is not None:  # validated on assignment: a bad mode fails naming eval.rerank
        cfg.eval.rerank = cast(Literal["none", PredictRerank], rerank)
    if cfg.eval.rerank == "mbr":  # before any model loads: a bad utility or pool fails at once, naming its key
        from rlt2t.ensemble import check_mbr_setup

        try:
            check_mbr_setup(cfg, 1)
        except ValueError as e:
            raise ValueError(f"eval.rerank=mbr: {e}") from None
    if cfg.eval.rerank == "reward":  # before any model loads: a reward that needs references fails now, named
        from rlt2t.ensemble import reference_free_reward

        reference_free_reward(cfg)
    decoding = "greedy" if cfg.eval.num_beams == 1 else f"beam {cfg.eval.num_beams}"
    decoding += "".join(f", {key} {value:g}" for key, value in cfg.eval.search_controls().items()
                        if value != SEARCH_CONTROLS[key])
    if cfg.eval.rerank != "none":
        decoding = f"{cfg.predict.pool} pool, rerank {cfg.eval.rerank}"
        if cfg.eval.rerank == "mbr":
            decoding += f" ({cfg.predict.mbr_utility}, {cfg.predict.mbr_weights})"
        elif cfg.eval.rerank == "reward":  # which reward picked: its terms, weighted
            from rlt2t.common.rewards import term_name

            decoding += " (" + " + ".join(term_name(t) if t.weight == 1 else f"{t.weight:g} × {term_name(t)}"
                                          for t in cfg.reward.terms if t.weight) + ")"
    # Before any model loads, built once for every row: the reward column's reward (a function that does not
    # import, or a reward model that is not there, fails now, naming the term).
    reward = eval_reward(cfg) if REWARD_COLUMN in cfg.eval.metrics else None
    rows: dict[str, dict[str, float]] = {}
    paths: dict[str, str] = {}
    for label, path in checkpoints.items():
        path = resolve_model_dir(path)
        rows[label] = eval_job(cfg, checkpoint=path, label=_file_label(label), reward=reward)
        paths[label] = str(path)
    limit = f", its first {cfg.eval.limit} examples (eval.limit)" if cfg.eval.limit else ""
    return EvalTable(title=title or f"{cfg.eval.split} split{limit}, {decoding} decoding", split=cfg.eval.split,
                     columns=list(cfg.eval.metrics), rows=rows, checkpoints=paths)
