"""Training curves as a PNG beside the run's logs (read from its metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("losses", ("loss", "ce", "rank_loss"), "train"),
    ("rewards", ("reward_mean", "reward_a", "reward_b", "reward_margin"), "train"),
    ("validation", ("monitor", "cider_d", "task_score"), "valid"),
)


Panel = tuple[str, tuple[str, ...], str | None]
"""(title, metric keys, row kind: "train", "valid", or None for both, each curve labelled with its kind)."""


def read_rows(metrics_jsonl: str | Path) -> list[dict]:
    """The rows of a stage's metrics.jsonl; a line a crash cut short is skipped."""
    rows = []
    for line in Path(metrics_jsonl).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line a crash cut short: the curves are drawn from the others
            continue
    return rows


def plot_curves(metrics_jsonl: str | Path, out_png: str | Path, title: str = "",
                panels: tuple[Panel, ...] = PANELS) -> Path | None:
    """Plot a stage's curves from its metrics.jsonl, one panel each (default: RL's losses; its rewards, the
    batch mean of a policy gradient's samples, rank RL's pair or DPO's implicit reward margin; and validation);
    None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(metrics_jsonl)
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (name, keys, kind) in zip(axes[0], panels, strict=True):
        for key in keys:
            for row_kind in (kind,) if kind is not None else ("train", "valid"):
                pts = [(r["step"], r[key]) for r in rows
                       if r.get("kind") == row_kind and isinstance(r.get(key), int | float)]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o" if row_kind == "valid" else None,
                            label=key if kind is not None else f"{row_kind} {key}")
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, out_png, title)


def plot_metric_bars(rows: dict[str, dict[str, float]], columns: list[str], out_png: str | Path,
                     title: str = "") -> Path:
    """One small bar panel per metric (their scales differ), one bar per model; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows or not columns:
        raise ValueError("a bar chart needs at least one model and one metric")
    per_row = min(4, len(columns))
    n_rows = -(-len(columns) // per_row)
    fig, axes = plt.subplots(n_rows, per_row, figsize=(3.2 * per_row, 2.8 * n_rows), squeeze=False)
    models = list(rows)
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(models))]
    for ax, column in zip(axes.flat, columns, strict=False):
        values = [rows[m][column] for m in models]
        bars = ax.bar(range(len(models)), values, color=colors)
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=7)
        ax.set_title(column, fontsize=9)
        ax.set_xticks(range(len(models)), models, rotation=20, ha="right", fontsize=8)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(columns):]:
        ax.axis("off")
    return _save(fig, out_png, title)


def plot_lines(curves: dict[str, list[tuple[float, float]]], out_png: str | Path, *, title: str = "",
               xlabel: str = "step", ylabel: str = "") -> Path:
    """One panel, one line (with markers) per label of ``curves`` ({label: [(x, y), ...]}); written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not any(curves.values()):
        raise ValueError("a line plot needs at least one point")
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, pts in curves.items():
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out_png, title)


def _save(fig, out_png: str | Path, title: str) -> Path:
    """Title, layout, then write ``out_png`` atomically (a temporary file renamed) and close the figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_name(f".{out_png.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
