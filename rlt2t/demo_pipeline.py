"""`rlt2t demo`: the whole method on the embedded default, ending with the comparison the product exists for.

    data → tokenizer → pretrain → SFT (stopped at its validation peak) → continued SFT → RL
         → validation and test tables → CTranslate2 export → ensemble prediction

Three models meet on the same splits: the SFT checkpoint RL starts from, *continued SFT* (the RL stage's
optimizer steps spent on cross-entropy on the gold targets of the same sources instead: what more likelihood
training would have given) and RL (``rl.algorithm``). RL is worth its cost when it beats both. The demo prints
each table as it is ready, a verdict line on the task score, and saves ``{run}/eval/demo-summary.json`` (what
``bench/demo_seeds.py`` collects over seeds) and ``{run}/eval/demo-validation.png`` (the validation monitor over
the SFT, continued-SFT and RL steps).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlt2t.cmd_common import print_table
from rlt2t.common.checkpoint import read_checkpoint
from rlt2t.common.config import Config
from rlt2t.common.io import atomic_write_json
from rlt2t.common.plots import plot_lines, read_rows
from rlt2t.ensemble import predict
from rlt2t.eval_table import EvalTable, eval_table, print_eval_table
from rlt2t.jobs import CONTINUED_SFT, best_or_latest, clean_run, continued_sft_job, export_job, prepare_sft, rl_job

log = logging.getLogger("rlt2t.demo")

DEMO_METRICS = ("task_score", "cider_d", "bleu4", "rouge_l", "mean_length")
VERDICT_METRIC = "task_score"
# The demo's models: key (summary, export directory) -> table label.
SFT, CONTINUED, RL = "sft", CONTINUED_SFT, "rl"


@dataclass
class DemoResult:
    """What the demo measured: ``scores[table][model]`` is the task score of model ``sft``, ``continued_sft`` or
    ``rl`` on table ``valid`` (greedy), ``test_greedy`` and ``test_ct2_beam`` (CTranslate2, beam
    ``predict.beam_size``); ``rl_ahead[table]`` whether RL beats both other models there."""

    run_dir: str
    seconds: float
    rl_algorithm: str | None
    metric: str = VERDICT_METRIC
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    rl_ahead: dict[str, bool] = field(default_factory=dict)
    curves_png: str | None = None
    tables: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    """Each table as printed: ``tables[table][row label][metric]``."""
    titles: dict[str, str] = field(default_factory=dict)
    """Each table's title as printed."""
    verdict: str = ""
    """The verdict lines as printed."""

    @property
    def rl_ahead_everywhere(self) -> bool:
        return bool(self.rl_ahead) and all(self.rl_ahead.values())


def run_demo(cfg: Config, *, fresh: bool = False, with_predict: bool = True) -> DemoResult:
    """Run (or resume) every stage of the demo in ``run.dir``, printing the tables; ``fresh`` deletes the demo's
    earlier outputs there first (:func:`rlt2t.jobs.clean_run`)."""
    if fresh:
        clean_run(cfg)
    t0 = time.perf_counter()
    prepare_sft(cfg)
    labels = {SFT: "sft"}
    models = {SFT: best_or_latest(cfg.run_dir / "sft" / "checkpoints")}
    if cfg.rl.enabled:
        continued_sft_job(cfg, resume=True)
        labels[CONTINUED], models[CONTINUED] = "continued sft", best_or_latest(cfg.run_dir / CONTINUED / "checkpoints")
        rl_job(cfg, resume=True)
        labels[RL], models[RL] = f"rl ({cfg.rl.algorithm})", best_or_latest(cfg.run_dir / "rl" / "checkpoints")
    result = DemoResult(run_dir=str(cfg.run_dir), seconds=0.0, rl_algorithm=cfg.rl.algorithm if cfg.rl.enabled
                        else None)
    # The same models on validation and on the held-out test split (`rlt2t eval`'s tables, saved under eval/).
    for split, key in (("valid", "valid"), ("test", "test_greedy")):
        if cfg.path(getattr(cfg.data, split)).is_file():
            table = eval_table(cfg, {labels[k]: path for k, path in models.items()}, split=split,
                               metrics=DEMO_METRICS)
            print_eval_table(table)
            table.save(cfg.run_dir / "eval", f"demo-{split}")
            result.scores[key] = _column(table, labels)
            result.tables[key], result.titles[key] = table.rows, table.title
    if with_predict and cfg.path(cfg.data.test).is_file():
        # The last stage of the method: CTranslate2 exports of the models, ensemble rerank on the test split.
        exports = [export_job(cfg, path, cfg.path(cfg.export.out) / k, force=True) for k, path in models.items()]
        predicted = predict(cfg, exports, exports, cfg.path(cfg.data.test), cfg.run_dir / "predict" / "test.csv",
                            metrics=DEMO_METRICS)
        if predicted.metrics:
            title = (f"test split, CTranslate2 {cfg.export.quantization}: single models (beam "
                     f"{cfg.predict.beam_size}) vs ensemble ({predicted.rerank}) vs oracle")
            print_table(title, predicted.metrics)
            result.titles["test_ct2_beam"] = title
            result.scores["test_ct2_beam"] = {k: predicted.metrics[k][VERDICT_METRIC] for k in models
                                              if k in predicted.metrics}
            result.tables["test_ct2_beam"] = predicted.metrics
        print(f"predictions: {predicted.csv_path}")
    result.seconds = round(time.perf_counter() - t0, 1)
    if RL in models:
        result.rl_ahead = {t: s[RL] > max(v for k, v in s.items() if k != RL) for t, s in result.scores.items()}
        result.verdict = verdict_line(result, labels)
        print(result.verdict)
    result.curves_png = str(_plot_validation(cfg, labels)) if cfg.metric.monitor_size else None
    atomic_write_json(cfg.run_dir / "eval" / "demo-summary.json", asdict(result))
    return result


def _column(table: EvalTable, labels: dict[str, str]) -> dict[str, float]:
    """The verdict metric of each demo model in ``table`` (rows are labelled with ``labels``)."""
    return {k: table.rows[label][VERDICT_METRIC] for k, label in labels.items()}


TABLE_NAMES = {"valid": "validation", "test_greedy": "test greedy", "test_ct2_beam": "test CTranslate2 beam"}


def verdict_line(result: DemoResult, labels: dict[str, str]) -> str:
    """One line per table: RL's score against the two likelihood baselines, relative, and where RL is ahead."""
    lines = [f"{labels[RL]} against {labels[SFT]} and {labels[CONTINUED]} ({result.metric}):"]
    for table, scores in result.scores.items():
        gains = ", ".join(f"{_relative(scores[RL], scores[k]):+.1%} over {labels[k]}" for k in (SFT, CONTINUED))
        lines.append(f"  {TABLE_NAMES.get(table, table):<22} {scores[RL]:.3f} ({gains})"
                     f"{'' if result.rl_ahead[table] else '  <- not ahead'}")
    lines.append("  RL is ahead of both on every table" if result.rl_ahead_everywhere else
                 "  RL is not ahead of both on every table")
    return "\n".join(lines)


def _relative(value: float, baseline: float) -> float:
    return (value - baseline) / abs(baseline) if baseline else float("inf") if value > 0 else 0.0


def _plot_validation(cfg: Config, labels: dict[str, str]) -> Path | None:
    """Validation CIDEr-D of greedy outputs (logged by every stage's monitor, whatever it selects by) after each
    epoch of SFT, then of continued SFT and RL from the SFT checkpoint they start at, against optimizer steps;
    None (with a warning) when it cannot be drawn."""
    logs = cfg.run_dir / "logs"
    out = cfg.run_dir / "eval" / "demo-validation.png"
    try:
        info = read_checkpoint(best_or_latest(cfg.run_dir / "sft" / "checkpoints"))
        start = info.step if info is not None else 0
        curves: dict[str, list[tuple[float, float]]] = {}
        for key, stage, offset in ((SFT, "sft", 0), (CONTINUED, CONTINUED, start), (RL, "rl", start)):
            path = logs / stage / "metrics.jsonl"
            if key in labels and path.is_file():
                pts = [(offset + r["step"], r["cider_d"]) for r in read_rows(path)
                       if r.get("kind") == "valid" and isinstance(r.get("cider_d"), int | float)]
                # Continued SFT and RL start where the SFT curve has its best point.
                begin = dict(curves.get(labels[SFT], [])).get(start) if key != SFT else None
                curves[labels[key]] = ([(start, begin)] if begin is not None else []) + pts
        return plot_lines(curves, out, title=f"validation CIDEr-D (greedy): {cfg.run_dir}",
                          xlabel="optimizer steps", ylabel="validation CIDEr-D")
    except (OSError, ValueError) as e:
        log.warning("demo: could not draw %s: %s", out, e)
        return None
