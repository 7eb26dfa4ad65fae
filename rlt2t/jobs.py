"""The stages of a run, wired from the one config tree. The CLI and `rlt2t demo` call these.

Each job takes the whole :class:`Config`, hands each component only its own sub-config, and
writes under ``run.dir``:

    data/            train/valid/test JSONL (synthetic or imported)
    tokenizer/       the saved tokenizer
    pretrain/checkpoints/epoch-0001 ...
    sft/checkpoints/epoch-0003 ...
    continued_sft/   the likelihood baseline of the RL stage (the demo's)
    rl/checkpoints/  the RL stage
    eval/            <checkpoint>-<split>.json metric tables and predictions
    logs/<stage>/    metrics.jsonl and TensorBoard events
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rlt2t.common.algorithms import same_algorithm
from rlt2t.common.checkpoint import (
    CheckpointInfo,
    best_or_latest,
    checkpoint_by_name,
    latest_complete_checkpoint,
    read_checkpoint,
    resolve_model_dir,
    resume_point,
)
from rlt2t.common.collate import encode_examples
from rlt2t.common.config import (
    Config,
    MetricTerm,
    RewardConfig,
    SFTConfig,
    TextStageConfig,
    config_to_yaml,
    shared_directory,
)
from rlt2t.common.data import Example, existing_splits, load_data, reference_sets, targets_of, unique_references
from rlt2t.common.errors import ResumableFailure
from rlt2t.common.example import UNLABELED_HINT, DataError
from rlt2t.common.io import atomic_directory, atomic_write_json, atomic_write_jsonl, atomic_write_text
from rlt2t.common.lora import load_lora_policy
from rlt2t.common.policy import (
    Policy,
    check_lengths,
    has_tokenizer,
    is_adapter_checkpoint,
    load_policy,
    lora_base,
    tokenizer_source,
)
from rlt2t.common.rewards import build_reward, check_reward, reference_readers
from rlt2t.common.synth import GENERATOR_VERSION, write_synthetic
from rlt2t.common.synth import META_FILE as SYNTH_META
from rlt2t.common.tokenization import build_tokenizer, load_tokenizer, save_tokenizer, text_checker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlt2t.learner.evaluate import RewardScores

log = logging.getLogger("rlt2t.jobs")


INIT_HINT = "pass --init, init= in Python, with the model to start from"
"""How a stage that starts from the run's SFT checkpoint can start from another model instead."""


def sft_start(cfg: Config, instead: str = INIT_HINT) -> Path:
    """The run's SFT checkpoint later stages start from (its best, else its newest); FileNotFoundError saying
    how to make one, or (``instead``) how to do without, when there is none."""
    try:
        return best_or_latest(cfg.run_dir / "sft" / "checkpoints")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} (run `rlt2t sft` first, or {instead})") from None


# The settings that shape a model's inputs: a stage that starts from another's checkpoint with other values here
# trains on inputs unlike those the checkpoint learned from, without an error (a longer source cut, other ids).
INPUT_SETTINGS = ("data.max_source_len", "data.max_target_len", "tokenizer")


def save_run_config(cfg: Config, command: str) -> None:
    """Save the tree ``command`` runs with as ``{run}/config/<command>.yaml``, first warning (:func:`unlike_earlier`)
    where its input settings differ from those the run's last other command saved."""
    changed = unlike_earlier(cfg, command)
    if changed:
        log.warning("%s: %s. A command reads only its own --config files and overrides: pass the same settings to "
                    "every command of a run (one YAML file, --config my_task.yaml)", command, "; ".join(changed))
    atomic_write_text(cfg.run_dir / "config" / f"{command}.yaml", config_to_yaml(cfg))


def unlike_earlier(cfg: Config, command: str) -> list[str]:
    """Each of :data:`INPUT_SETTINGS` (a key, or every key of a section) whose value in ``cfg`` differs from the
    config the run's newest other command saved, as ``key=<here> (<value> in <file>)``; [] when there is none
    or it cannot be read (another version's)."""
    saved = _saved_configs(cfg, skip=command)
    earlier = _read_saved(saved[0]) if saved else None
    if earlier is None:
        return []
    where = saved[0].relative_to(cfg.run_dir)
    now, then = cfg.model_dump(mode="json"), earlier.model_dump(mode="json")
    changed = []
    for setting in INPUT_SETTINGS:
        section, _, key = setting.partition(".")
        pairs = ({setting: (now[section][key], then[section].get(key))} if key else
                 {f"{section}.{k}": (v, then[section].get(k)) for k, v in now[section].items()})
        changed += [f"{k}={here} ({there} in {where})" for k, (here, there) in pairs.items() if here != there]
    return changed


def check_task_out(cfg: Config, fmt: str = "jsonl", force: bool = False) -> None:
    """Refuse to write a generated task over split files already in data.train's directory unless ``force``
    (`rlt2t data synth|wordnet|docstrings|docstring-names` and ``rlt2t.synth_data``; the demo, which regenerates
    its own synthetic task, does not come through here)."""
    out = cfg.path(cfg.data.train).parent
    existing = existing_splits(out, fmt=fmt)
    if existing and not force:
        raise FileExistsError(f"{out} already holds {', '.join(existing)} (pass --force on the command line, "
                              "force=True in Python, to replace them, or give the task another run.dir)")


def synthetic_data_in_place(cfg: Config, fmt: str = "jsonl") -> dict[str, Path] | None:
    """The split files of data.train's directory when the synthetic task there is the one ``cfg`` would write
    (its ``synth_meta.json`` has the same generator version, size, seed, fractions, format and token count, and
    every file is there); else None."""
    out = cfg.path(cfg.data.train).parent
    try:
        meta = json.loads((out / SYNTH_META).read_text())
    except (OSError, ValueError):
        return None
    s = cfg.synth
    wanted = {"version": GENERATOR_VERSION, "size": s.size, "seed": s.seed, "fmt": fmt,
              "valid_fraction": s.valid_fraction, "test_fraction": s.test_fraction,
              "num_data_tokens": cfg.tokenizer.num_data_tokens}
    paths = {name: out / f"{name}.{fmt}" for name in ("train", "valid", "test")}
    if any(meta.get(k) != v for k, v in wanted.items()) or not all(p.is_file() for p in paths.values()):
        return None
    return {**paths, "meta": out / SYNTH_META}


def make_synthetic_data(cfg: Config, fmt: Literal["jsonl", "csv"] = "jsonl") -> dict[str, Path]:
    out = cfg.path(cfg.data.train).parent
    s = cfg.synth
    files = write_synthetic(out, s.size, s.seed, valid_fraction=s.valid_fraction, test_fraction=s.test_fraction,
                            fmt=fmt, num_data_tokens=cfg.tokenizer.num_data_tokens)
    log.info("synthetic data (%d rows, seed %d) → %s", s.size, s.seed, out)
    return files


def make_wordnet_data(cfg: Config, *, size: int = 8000, seed: int = 7,
                      wordnet_dir: str | None = None) -> dict[str, Path]:
    """The WordNet definition-modelling task (``rlt2t.common.wordnet``) into data.train's directory."""
    from rlt2t.common.wordnet import write_wordnet_task

    out = cfg.path(cfg.data.train).parent
    files = write_wordnet_task(out, size, seed, valid_fraction=cfg.synth.valid_fraction,
                               test_fraction=cfg.synth.test_fraction, wordnet_dir=wordnet_dir)
    log.info("WordNet definitions (%d rows, seed %d) → %s", size, seed, out)
    return files


def make_docstring_data(cfg: Config, *, size: int = 8000, seed: int = 7) -> dict[str, Path]:
    """The docstring-summary task (``rlt2t.common.docstrings``) into data.train's directory."""
    from rlt2t.common.docstrings import write_docstring_task

    out = cfg.path(cfg.data.train).parent
    files = write_docstring_task(out, size, seed, valid_fraction=cfg.synth.valid_fraction,
                                 test_fraction=cfg.synth.test_fraction)
    log.info("docstring summaries (%d rows, seed %d) → %s", size, seed, out)
    return files


def make_docstring_names_data(cfg: Config, *, seed: int = 7, max_references: int = 10) -> dict[str, Path]:
    """The several-reference docstring task (function name → every summary of that name;
    ``rlt2t.common.docstrings``) into data.train's directory."""
    from rlt2t.common.docstrings import write_docstring_names_task

    out = cfg.path(cfg.data.train).parent
    files = write_docstring_names_task(out, seed, valid_fraction=cfg.synth.valid_fraction,
                                       test_fraction=cfg.synth.test_fraction, max_references=max_references)
    log.info("docstring names (seed %d, at most %d references each) → %s", seed, max_references, out)
    return files


def load_split(cfg: Config, split: str, require_target: bool = True) -> Sequence[Example]:
    """Load a configured split (any format of data.format, with the data.*_field mapping), checking texts against
    the tokenizer's vocabulary when it has one. A list for JSONL and CSV; for Parquet and datasets a sequence that
    builds each example when it is read (``rlt2t.common.data_formats``)."""
    return _load_checked(cfg, split_path(cfg, split), require_target)


def split_path(cfg: Config, split: str) -> Path:
    """The file of a configured split; FileNotFoundError naming ``data.<split>`` and how to get one when it does
    not exist."""
    path = cfg.path(getattr(cfg.data, split))
    if not path.exists():
        saved = _saved_config_with(cfg, split)
        hint = (f"point data.{split} at your file, or pass the run's saved config, which holds the data paths of its "
                f"earlier commands (--config {saved})" if saved else
                "point data.train / data.valid / data.test at your files, `rlt2t data import` one, or `rlt2t data "
                "synth` the demo's")
        if split == "test":
            hint += "; `rlt2t data import` writes a test split only with --test-fraction"
        raise FileNotFoundError(f"data.{split}: {path} does not exist ({hint})")
    return path


def _load_checked(cfg: Config, path: Path, require_target: bool, check: bool = True) -> Sequence[Example]:
    tokenizer = text_tokenizer_dir(cfg) if check else None
    checker = text_checker(load_tokenizer(tokenizer)) if tokenizer is not None else None
    return load_data(path, cfg.data, require_target=require_target, check_text=checker)


def unlabeled_texts(cfg: Config, *, check: bool = True) -> list[str]:
    """The sources of the data.unlabeled files, read as a split's (``check``: their texts checked with the run's
    tokenizer, :func:`text_tokenizer_dir`)."""
    texts: list[str] = []
    for i, name in enumerate(cfg.data.unlabeled):
        path = cfg.path(name)
        if not path.exists():
            raise FileNotFoundError(f"data.unlabeled[{i}]: {path} does not exist")
        texts += [e.source for e in _load_checked(cfg, path, require_target=False, check=check)]
    return texts


def text_tokenizer_dir(cfg: Config) -> Path | None:
    """The tokenizer the run's texts are checked and measured with, as ``load_policy`` picks it: the one in
    model.path (a pretrained directory's own), else the run's tokenizer directory; None when there is neither."""
    return tokenizer_source(cfg.model.path or None, cfg.tokenizer_dir if cfg.tokenizer_dir.is_dir() else None)


def _saved_config_with(cfg: Config, split: str) -> Path | None:
    """The newest config an earlier command of the run saved whose ``data.<split>`` is a file that exists (not
    the one this command just saved with the same missing path)."""
    for saved in _saved_configs(cfg):
        earlier = _read_saved(saved)
        if earlier is not None and earlier.path(getattr(earlier.data, split)).exists():
            return saved
    return None


def _saved_configs(cfg: Config, skip: str | None = None) -> list[Path]:
    """The configs the run's commands saved (:func:`save_run_config`), newest first, but ``skip``'s."""
    return sorted((p for p in (cfg.run_dir / "config").glob("*.yaml") if p.stem != skip),
                  key=lambda p: p.stat().st_mtime, reverse=True)


def _read_saved(path: Path) -> Config | None:
    """A saved config as a tree; None for one of another version, or unreadable."""
    from rlt2t.common.config import load_config

    try:
        return load_config([path], [])
    except (ValueError, OSError):
        return None


def build_tokenizer_job(cfg: Config, *, force: bool = False) -> Path:
    """Build (ids), train (subword) or copy (pretrained) the tokenizer into the run's tokenizer dir. Refused when
    model.path holds its own tokenizer: every command reads that one, none would read this. A tokenizer already
    there is kept when it is the same one, and replaced by another only with ``force``: the run's models and
    data checks were made with it."""
    own = tokenizer_source(cfg.model.path, None) if cfg.model.path else None
    if own is not None:
        raise ValueError(f"model.path={cfg.model.path} brings its own tokenizer ({own}), which every command uses with "
                         "it: a tokenizer built here would be read by none. Leave out `rlt2t tokenizer build` for a "
                         "pretrained model (it is for a model built from model.preset)")
    t = cfg.tokenizer
    out = cfg.run_dir / "tokenizer" if t.kind == "pretrained" or t.path is None else cfg.tokenizer_dir
    texts = None
    if t.kind == "subword":  # trained on the training split's sources and references, and data.unlabeled's texts
        train = load_data(split_path(cfg, "train"), cfg.data, require_target=False)
        texts = [x for e, refs in unique_references(train) for x in (e.source, *refs)]
        texts += unlabeled_texts(cfg, check=False)  # the tokenizer they are checked with is the one being built
        if not any(x.strip() for x in texts):
            raise ValueError(f"tokenizer.kind=subword: no text to learn a vocabulary from in data.train "
                             f"({cfg.path(cfg.data.train)}){' or data.unlabeled' if cfg.data.unlabeled else ''}")
    tok = build_tokenizer(t.kind, num_data_tokens=t.num_data_tokens, num_sentinels=t.num_sentinels,
                          vocab_size=t.vocab_size, train_texts=texts, path=cfg.path(t.path) if t.path else None)
    if out.is_dir():
        earlier = _loaded_tokenizer(out)
        if earlier is not None and _same_tokenizer(earlier, tok):
            log.info("tokenizer (%s, %d tokens): %s holds this one already, left as it is", t.kind, len(tok), out)
            return out
        if not force:
            held = f"{len(earlier)} tokens" if earlier is not None else "one that does not load"
            raise FileExistsError(f"{out} holds another tokenizer ({held}; these settings build {len(tok)}), which "
                                  "the run's models and checks were made with: pass --force (force=True) to replace "
                                  "it, or build into a new run.dir")
    with atomic_directory(out) as tmp:
        save_tokenizer(tok, tmp)
    log.info("tokenizer (%s, %d tokens) → %s", t.kind, len(tok), out)
    if texts is not None and len(tok) < t.vocab_size:
        log.info("tokenizer: %d of tokenizer.vocab_size=%d tokens: %d texts held no more merges (more text, e.g. "
                 "data.unlabeled, gives a larger vocabulary)", len(tok), t.vocab_size, len(texts))
    return out


def _loaded_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    try:
        return load_tokenizer(path)
    except Exception:  # a partial or foreign directory: not the same tokenizer, whatever it holds
        return None


def _same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """The same ids for the same tokens, and the same special tokens."""
    return a.get_vocab() == b.get_vocab() and a.special_tokens_map == b.special_tokens_map


def _stage_start(cfg: Config, stage: str, init: str | Path | None, resume: bool
                 ) -> tuple[Policy, CheckpointInfo | None]:
    """Load the policy for a stage: resume its own newest checkpoint, else start from ``init``."""
    latest = resume_point(cfg.run_dir / stage / "checkpoints", resume)
    if latest is not None:
        info = read_checkpoint(latest)
        if is_adapter_checkpoint(latest):  # a LoRA stage: its base + the adapters, trainable
            return load_lora_policy(cfg.model, cfg.tokenizer_dir, latest), info
        return load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=latest), info
    if init is not None:
        init = resolve_model_dir(init)
        log.info("%s: starting from %s", stage, init)
        _warn_other_tokenizer(cfg, stage, init)
    return load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=init, seed=cfg.run.seed), None


def _warn_other_tokenizer(cfg: Config, stage: str, init: Path) -> None:
    """A stage started from a checkpoint trains with the checkpoint's own tokenizer, while the run's texts are
    checked and measured with :func:`text_tokenizer_dir`'s: a warning when the two vocabularies differ (a
    tokenizer rebuilt after pretraining is not the one the pretrained model reads)."""
    own, checked = tokenizer_source(init, None), text_tokenizer_dir(cfg)
    if own is None or checked is None or own.resolve() == checked.resolve():
        return
    own_tok, checked_tok = load_tokenizer(own), load_tokenizer(checked)
    if own_tok.get_vocab() != checked_tok.get_vocab():
        log.warning("%s: %s brings its own tokenizer (%d tokens), which the model trains with; the data is checked "
                    "with %s (%d tokens), a different vocabulary (rebuilt after that checkpoint was made?): rebuild "
                    "the checkpoint from the current tokenizer, or put the checkpoint's tokenizer back",
                    stage, init, len(own_tok), checked, len(checked_tok))


def _on_ranks(stage_cfg: TextStageConfig) -> bool:
    """The stage trains on several ranks (its ``strategy``) and this is the driver, not yet one of them."""
    import torch.distributed as dist

    return stage_cfg.strategy != "local" and not dist.is_initialized()


def _main_rank() -> bool:
    """One process, or rank 0 of a stage's ranks: what writes the run's files."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def pretrain_job(cfg: Config, resume: bool = False, init: str | Path | None = None):
    from rlt2t.learner.stages import run_pretrain

    if _on_ranks(cfg.pretrain):
        from rlt2t.stage_group import run_on_ranks

        return run_on_ranks(cfg, "pretrain", resume, init)
    if _main_rank():
        save_run_config(cfg, "pretrain")
    policy, info = _stage_start(cfg, "pretrain", init, resume)
    check_lengths(policy, cfg.data)
    tok = policy.tokenizer
    texts = []
    for split in ("train", "valid", "test"):
        path = cfg.path(getattr(cfg.data, split))
        if not path.exists():
            continue
        examples = load_split(cfg, split, require_target=False)
        texts += [e.source for e in examples]
        if split == "train":  # held-out targets stay unseen
            texts += [r for refs in reference_sets(examples) for r in refs]
    if cfg.data.unlabeled:
        extra = unlabeled_texts(cfg)
        log.info("pretrain: %d texts of data.unlabeled besides the splits' %d", len(extra), len(texts))
        texts += extra
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    limit = cfg.data.max_source_len - 1
    ids = [x[:limit] for x in ids if x]
    return run_pretrain(policy, ids, cfg.pretrain, cfg.run, cfg.run_dir / "pretrain", resume_from=info,
                        fsdp=cfg.rl.fsdp)


def default_sft_init(cfg: Config) -> Path | None:
    """SFT starts from the newest pretraining checkpoint of the run when there is one (a warning when model.path
    names another model than the one that pretraining started from: the checkpoint wins)."""
    latest = latest_complete_checkpoint(cfg.run_dir / "pretrain" / "checkpoints")
    if latest is not None and cfg.model.path and _stage_model_path(cfg, "pretrain") != cfg.model.path:
        log.warning("sft: starting from this run's pretraining checkpoint %s, not from model.path=%s (pretraining "
                    "did not start from it); to fine-tune model.path, use another run.dir or pass --init %s",
                    latest, cfg.model.path, cfg.model.path)
    return latest


def _stage_model_path(cfg: Config, stage: str) -> str | None:
    """The model.path a stage of the run was started with (its saved config), None when unknown or unset."""
    import yaml

    try:
        saved = yaml.safe_load((cfg.run_dir / "config" / f"{stage}.yaml").read_text()) or {}
        return (saved.get("model") or {}).get("path") or None
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def sft_job(cfg: Config, resume: bool = False, init: str | Path | None = None):
    """SFT (``cfg.sft``) on the training split into ``{run}/sft``, from ``init`` or the run's pretraining."""
    return _sft_stage(cfg, "sft", cfg.sft, load_split(cfg, "train"),
                      init if init is not None else default_sft_init(cfg), resume)


CONTINUED_SFT = "continued_sft"


def continued_sft_job(cfg: Config, resume: bool = False, init: str | Path | None = None):
    """The likelihood baseline an RL run is measured against: SFT continued from RL's start (``init``, default
    the run's best SFT checkpoint) with the RL stage's budget — CE on the gold targets of the same rows (the first
    ``rl.train_subset``), ``rl.epochs`` passes, ``rl.batch_size`` rows a step (so the same number of optimizer
    steps), ``rl.lr`` with its warm-up and floor — into ``{run}/continued_sft``, keeping its best checkpoint
    by the validation metric as RL does (``sft.monitor`` does not apply). SFT's other settings (R-drop,
    augmentation, FGM) carry over."""
    r = cfg.rl
    stage_cfg = cfg.sft.model_copy(update=dict(
        epochs=r.epochs, max_steps=r.max_steps, batch_size=r.batch_size, lr=r.lr, weight_decay=r.weight_decay,
        warmup_ratio=r.warmup_ratio, min_lr_ratio=r.min_lr_ratio, grad_clip=r.grad_clip, save_every_steps=0,
        keep_last=r.keep_last, patience=0, monitor="metric"))
    rows = load_split(cfg, "train")
    if r.train_subset:
        rows = rows[: r.train_subset]
    start = init if init is not None else sft_start(cfg)
    return _sft_stage(cfg, CONTINUED_SFT, stage_cfg, rows, start, resume)


def _sft_stage(cfg: Config, stage: str, stage_cfg: SFTConfig, train: Sequence[Example], init: str | Path | None,
               resume: bool):
    """Supervised training on ``train`` with ``stage_cfg`` into ``{run}/<stage>``, monitored on validation."""
    from rlt2t.common.rewards import local_reward
    from rlt2t.learner.evaluate import job_monitor, monitor_name, monitor_score
    from rlt2t.learner.stages import run_sft

    # What scores the greedy outputs: metric.monitor, except that a stage monitored by its loss logs the default
    # metric beside it rather than building a reward (its reward model may not exist yet) to log
    scored = cfg if stage_cfg.monitor == "metric" or cfg.metric.monitor != "reward" else cfg.model_copy(
        update={"metric": cfg.metric.model_copy(update={"monitor": "default"})})
    if _on_ranks(stage_cfg):  # each rank calls this job again, with the same (resolved) start
        from rlt2t.stage_group import run_on_ranks

        if scored.metric.monitor == "reward":
            check_reward(cfg.reward)  # a function that does not import fails here, not on the ranks
        else:
            job_monitor(scored)  # an unknown metric likewise
        return run_on_ranks(cfg, stage, resume, init)
    if _main_rank():
        save_run_config(cfg, stage)
    policy, info = _stage_start(cfg, stage, init, resume)
    check_lengths(policy, cfg.data)
    enc = encode_examples(policy.tokenizer, [e.source for e in train], targets_of(train, f"{stage} (data.train)"),
                          cfg.data.max_source_len, cfg.data.max_target_len, what="train")
    evaluate = None
    monitor_by = "-valid_loss" if stage_cfg.monitor == "loss" else monitor_name(scored.metric)
    if cfg.metric.monitor_size and cfg.path(cfg.data.valid).exists():
        valid = load_split(cfg, "valid")[: cfg.metric.monitor_size]
        # Every rank decodes (under FSDP the weights are gathered for it); rank 0's score is every rank's.
        monitor = (job_monitor(scored, lambda: local_reward(cfg.reward, reference_sets(train))) if _main_rank()
                   else lambda examples, hyps: math.nan)

        def evaluate(model):
            return monitor_score(Policy(model, policy.tokenizer, policy.origin), valid, scored.metric,
                                 max_source_len=cfg.data.max_source_len, max_new_tokens=cfg.eval.max_new_tokens,
                                 by=stage_cfg.monitor, max_target_len=cfg.data.max_target_len, monitor=monitor)

    patience_counts = None
    if evaluate is not None:
        from rlt2t.learner.evaluate import COLLAPSE_RATIO, collapse_reference

        floor = COLLAPSE_RATIO * (collapse_reference(valid) or 0.0)  # once, not every epoch

        def patience_counts(scores: dict[str, float]) -> bool:
            # An epoch whose greedy outputs have collapsed (the decoder has not yet learned to read its source)
            # does not count toward sft.patience: early stopping waits for SFT to start learning.
            return scores.get("distinct_outputs", floor) >= floor

    result = run_sft(policy, enc.sources, enc.targets, stage_cfg, cfg.run, cfg.run_dir / stage, resume_from=info,
                     evaluate=evaluate, lora=cfg.model.lora, max_source_len=cfg.data.max_source_len, stage=stage,
                     patience_counts=patience_counts, fsdp=cfg.rl.fsdp, monitor_by=monitor_by)
    if evaluate is not None and _main_rank():
        warn_if_collapsed(cfg, best_or_latest(cfg.run_dir / stage / "checkpoints"), valid)
    return result


STAGE_JOBS = {"pretrain": pretrain_job, "sft": sft_job, CONTINUED_SFT: continued_sft_job}
"""The stages that may train on several ranks (``strategy``), by name: what each rank runs."""


def warn_if_collapsed(cfg: Config, checkpoint: Path, valid: Sequence[Example]) -> None:
    """Warn when a checkpoint RL starts from (an SFT one, or an earlier RL round's) writes the same few texts
    whatever its source: its recorded validation ``distinct_outputs``
    (:func:`rlt2t.learner.evaluate.collapse_warning`). The figure was measured on the validation subset of the
    run that wrote it; ``valid`` gives the references' variety to compare it with."""
    from rlt2t.learner.evaluate import collapse_warning

    meta = info.meta if (info := read_checkpoint(checkpoint)) is not None else {}
    distinct = (meta.get("metrics") or {}).get("distinct_outputs")
    if distinct is None:  # a model directory, or a checkpoint written before the monitor recorded it
        return
    stage = meta.get("stage") or "sft"
    advice = (f"train it again with a lower sft.lr (now {cfg.sft.lr:g}), a longer warm-up (sft.warmup_ratio, now "
              f"{cfg.sft.warmup_ratio:g}) or another run.seed before RL starts from it" if stage == "sft" else
              f"start from an earlier checkpoint of that {stage} run, or rerun it with a lower learning rate")
    if cfg.model.preset == "tiny" and not cfg.model.path:  # a model too small to learn much: no setting helps
        advice += "; or a larger model: model.preset=tiny is for tests, and on most tasks it learns too little"
    message = collapse_warning(f"{stage}: {checkpoint}", distinct, valid, advice)
    if message:
        log.warning(message)


def checkpoint_label(path: Path) -> str:
    """A checkpoint ``<stage>/checkpoints/<name>`` reads ``<stage>-<name>`` (``sft-epoch-0003``: the stages' own
    checkpoints share names, as eval's tables label them), a model directory its name: export's default --out."""
    return f"{path.parent.parent.name}-{path.name}" if path.parent.name == "checkpoints" else path.name


def export_job(cfg: Config, checkpoint: str | Path, out: str | Path | None = None, *,
               quantization: str | None = None, force: bool = False) -> Path:
    """CTranslate2 export of a model dir / checkpoint / checkpoint root (newest), with its IDF table."""
    from rlt2t.common.checkpoint import resolve_model_dir
    from rlt2t.common.ct2 import export_ct2
    from rlt2t.ensemble import save_idf_beside

    source = Path(checkpoint)
    if not source.exists():
        raise FileNotFoundError(f"--checkpoint {source}: no such directory")
    try:
        model_dir = resolve_model_dir(source)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--checkpoint: {e}") from None
    out = Path(out) if out else cfg.path(cfg.export.out) / checkpoint_label(model_dir)
    quantization = quantization or cfg.export.quantization
    export_ct2(model_dir, out, quantization, force=force,
               tokenizer_dir=cfg.tokenizer_dir if cfg.tokenizer_dir.is_dir() else None)
    idf = save_idf_beside(cfg, out)
    log.info("export: %s → %s (%s)%s", model_dir, out, quantization, f"; IDF table {idf}" if idf else "")
    return out


def eval_job(cfg: Config, checkpoint: str | Path | None = None, label: str | None = None,
             reward: RewardScores | None = None) -> dict[str, float]:
    """Decode ``cfg.eval.split`` with one model and score it (``cfg.eval.metrics``); save its scores and predictions
    under ``{run}/eval``. ``reward`` scores the ``reward`` column (None: built here from reward.terms when the
    column is asked for)."""
    from rlt2t.learner.evaluate import REWARD_COLUMN, evaluate

    if REWARD_COLUMN in cfg.eval.metrics and reward is None:
        reward = eval_reward(cfg)

    ckpt = resolve_model_dir(checkpoint) if checkpoint else sft_start(cfg, "name the model to evaluate")
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=ckpt)  # an adapter checkpoint loads merged
    examples = load_split(cfg, cfg.eval.split)
    if cfg.eval.limit:
        examples = examples[: cfg.eval.limit]
    decoding: dict[str, object] = {"num_beams": cfg.eval.num_beams, **cfg.eval.search_controls()}
    hyps = None
    if cfg.eval.rerank != "none":  # a pool per source, picked from as `rlt2t predict` does
        from rlt2t.ensemble import rerank_with_policy

        reranked = rerank_with_policy(cfg, policy, ckpt, examples, cfg.eval.rerank)
        hyps = reranked.predictions
        p = cfg.predict
        mbr = {"mbr_utility": p.mbr_utility, "mbr_weights": p.mbr_weights} if cfg.eval.rerank == "mbr" else {}
        # the pool's settings, enough to draw the same pool again (torch backend: rerank_with_policy)
        beams = ({"beam_size": p.beam_size, "num_hypotheses": p.num_hypotheses,
                  "no_repeat_ngram_size": p.no_repeat_ngram_size, "repetition_penalty": p.repetition_penalty,
                  "length_penalty": p.length_penalty, "min_new_tokens": p.min_new_tokens}
                 if p.pool != "sample" else {})
        sampled = ({"num_samples": p.num_samples, "top_k": p.top_k, "top_p": p.top_p, "epsilon": p.epsilon,
                    "temperature": p.temperature, "seed": p.seed} if p.pool != "beam" else {})
        decoding = {"rerank": cfg.eval.rerank, "pool": p.pool, **beams, **sampled, **mbr,
                    "seconds_per_source": {k: v / max(1, len(examples)) for k, v in reranked.seconds.items()}}
    result = evaluate(policy, examples, cfg.eval, cfg.metric, cfg.data.max_source_len, progress=cfg.run.progress,
                      max_target_len=cfg.data.max_target_len, predictions=hyps, reward=reward)
    label = label or f"{ckpt.parent.parent.name}-{ckpt.name}"
    out = cfg.run_dir / "eval"
    info = read_checkpoint(ckpt)  # a checkpoint says how it was trained: its stage, and RL's algorithm
    trained = {k: info.meta[k] for k in ("stage", "algorithm") if k in info.meta} if info is not None else {}
    atomic_write_json(out / f"{label}-{cfg.eval.split}.json",
                      {"checkpoint": str(ckpt), **trained, "split": cfg.eval.split, **decoding,
                       "examples": len(result.predictions), **result.metrics})
    atomic_write_jsonl(out / f"{label}-{cfg.eval.split}.predictions.jsonl",
                       ({"id": e.id, "prediction": p, "target": e.target,
                         **({"references": list(e.references)} if e.references else {})}
                        for e, p in zip(examples, result.predictions, strict=False)))
    return result.metrics


def eval_reward(cfg: Config) -> RewardScores:
    """The run's reward (``reward.terms``, built in this process, its learned terms on ``reward.device``) as the
    eval table's ``reward`` column scores with it; ConfigError naming the term when it cannot be built."""
    check_reward(cfg.reward)
    return build_reward(cfg.reward, device=cfg.reward.device).score


# What `rlt2t demo` writes under run.dir, all that `demo --fresh` deletes: anything else there (annotations,
# feedback rounds, reward models, the user's own files) is kept.
FRESH_ENTRIES = ("config", "data", "tokenizer", "pretrain", "sft", CONTINUED_SFT, "rl", "eval", "logs", "export",
                 "predict")
# The demo's mark on a run.dir whose stage outputs it wrote (prepare_sft leaves it in a run.dir that held none of
# them); --fresh deletes nothing in a run.dir without it.
DEMO_MARKER = ".rlt2t-demo"


def _check_deletable_run_dir(cfg: Config) -> Path:
    """run.dir resolved; ValueError when it is the filesystem root, the home directory, the current directory
    or a parent of one of these (``run.dir=..`` would otherwise wipe the user's files). The config refuses these
    already; checked again here, where the files go, in case the process has since changed directory."""
    if (problem := shared_directory(cfg.run.dir)) is not None:
        raise ValueError(f"run.dir={cfg.run.dir!r} {problem}: --fresh deletes the run's outputs there; give the "
                         "run its own directory, e.g. run.dir=runs/demo")
    return cfg.run_dir.expanduser().resolve()


def _fresh_deletions(run_dir: Path) -> list[Path]:
    """What --fresh deletes in ``run_dir``: the ``FRESH_ENTRIES`` there (``data/`` only when it holds the demo's
    synthetic task) and what a killed atomic write of one of them left beside it (rlt2t.common.io: .tmp-NAME-*,
    .old-NAME-*)."""
    entries = [run_dir / name for name in FRESH_ENTRIES if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    data = run_dir / "data"
    if data.is_dir() and not (data / SYNTH_META).is_file():  # imported or generated by the user, not the demo
        entries.remove(data)
    leftovers = [p for name in FRESH_ENTRIES for pattern in (f".tmp-{name}-*", f".old-{name}-*")
                 for p in run_dir.glob(pattern)]
    return entries + leftovers


def mark_demo_run(cfg: Config) -> None:
    """Leave ``DEMO_MARKER`` in run.dir when the demo's stages start there and it holds none of their outputs yet
    (or only data the demo keeps): the outputs that follow are the demo's, for --fresh to delete. A run.dir with
    outputs of unknown origin stays unmarked, so --fresh refuses it."""
    run_dir = cfg.run_dir
    if (run_dir / DEMO_MARKER).is_file() or (run_dir.is_dir() and _fresh_deletions(run_dir)):
        return
    atomic_write_text(run_dir / DEMO_MARKER, "outputs of `rlt2t demo`: `rlt2t demo --fresh` deletes them "
                                             f"({', '.join(FRESH_ENTRIES)})\n")


def clean_run(cfg: Config) -> None:
    """Delete the stage outputs of the run (``FRESH_ENTRIES`` under run.dir) so the demo starts over.

    Refuses a run.dir that is the current directory, the home directory, the root or a parent of one of them,
    and one that holds such entries without the demo's ``DEMO_MARKER`` (not the demo's run: config/, logs/ ...
    may be the user's); only the known entries go (a symlink among them is unlinked, never followed), everything
    else stays, and ``data/`` only when it holds the demo's synthetic task (an import-csv or `rlt2t data` task
    stays)."""
    run_dir = _check_deletable_run_dir(cfg)
    if not run_dir.is_dir():
        return
    doomed = _fresh_deletions(run_dir)
    if doomed and not (run_dir / DEMO_MARKER).is_file():
        names = ", ".join(sorted(p.name for p in doomed))
        raise FileExistsError(
            f"--fresh: {run_dir} holds {names} but not the demo's marker {DEMO_MARKER}: they may not be the demo's "
            f"outputs, so nothing was deleted. Give the demo its own run.dir (e.g. run.dir=runs/demo) or delete them "
            f"yourself (if an earlier demo wrote them: `touch {run_dir / DEMO_MARKER}`, then rerun)")
    data = run_dir / "data"
    if data.is_dir() and data not in doomed:
        log.info("--fresh: kept %s (no %s: not the demo's synthetic data)", data, SYNTH_META)
    for entry in doomed:
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.is_dir():
            shutil.rmtree(entry)
    kept = sorted(p.name for p in run_dir.iterdir() if p.name != DEMO_MARKER)
    if kept:
        log.info("--fresh: kept %s in %s (not written by the demo)", ", ".join(kept), run_dir)


def _recorded_start(cfg: Config, recorded: str) -> Path:
    """The start an RL run recorded, found again after the run moved (an SFT checkpoint of the run: by name under
    its sft/checkpoints); FileNotFoundError naming --init when it is gone."""
    if Path(recorded).exists():
        return Path(recorded)
    moved = checkpoint_by_name(cfg.run_dir / "sft" / "checkpoints", recorded)
    if moved is None:
        raise FileNotFoundError(f"rl: the run started from {recorded}, which no longer exists (nor a checkpoint of "
                                f"that name under {cfg.run_dir / 'sft' / 'checkpoints'}); pass --init (init= in "
                                "Python) with the model it started from: it is the KL's reference policy")
    return moved


def rl_job(cfg: Config, resume: bool = False, init: str | Path | None = None, stop_after_steps: int = 0,
           reference: str | Path | None = None):
    """RL on Ray (``rl.algorithm``) from the run's best SFT checkpoint (or ``init``); ``resume`` continues the
    newest checkpoint of the run's RL stage. The KL's reference policy is ``reference``, else the start (as a
    resumed run recorded it)."""
    from rlt2t.driver import STAGE, train

    latest = resume_point(cfg.run_dir / STAGE / "checkpoints", resume)
    resumed = read_checkpoint(latest) if latest else None
    recorded = resumed.meta.get("algorithm") if resumed is not None else None
    if recorded and not same_algorithm(recorded, cfg.rl.algorithm):  # refused before the run's config is saved
        raise ValueError(f"rl.algorithm={cfg.rl.algorithm}, but {latest} was trained with rl.algorithm={recorded}: "
                         f"resume with rl.algorithm={recorded}, or start a new run.dir from it (--init {latest}, "
                         "init= in Python) to go on with another algorithm")
    save_run_config(cfg, STAGE)
    if init:
        start = resolve_model_dir(init)
    elif resumed is not None and resumed.meta.get("init"):
        start = _recorded_start(cfg, resumed.meta["init"])  # the reference policy of the KL stays the run's start
    else:
        start = sft_start(cfg)
    ref = resolve_model_dir(reference) if reference else start
    shown: str | Path = ref
    if cfg.model.lora.enabled:  # the KL's reference is the adapters' base, with the adapters disabled
        base = lora_base(ref)
        if lora_base(latest or start).resolve() != base.resolve():
            raise ValueError(f"model.lora: the adapters trained from {latest or start} adapt "
                             f"{lora_base(latest or start)}, but the KL reference {ref} is {base} with LoRA (its "
                             "base, adapters disabled): give a reference on the same base, or train without LoRA")
        shown = f"{base}, the adapters' base" if base.resolve() != Path(ref).resolve() else ref
    _tokenizer_from(cfg, start)
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=latest or start)
    check_lengths(policy, cfg.data, {"rollout.max_new_tokens": cfg.rollout.max_new_tokens})
    train_set, valid = rl_splits(cfg)
    log.info("rl: starting from %s (KL reference %s)", latest or start, shown)
    for name in cfg.rl.unused_sections:
        log.warning("rl: rl.%s is set, but rl.algorithm=%s: its settings are not used in this run (rl.algorithm=%s "
                    "uses them)", name, cfg.rl.algorithm, name)
    if resumed is None:
        warn_if_bleu_cannot_score(cfg, train_set[: cfg.rl.train_subset or None])
    if resumed is None and valid:
        warn_if_collapsed(cfg, start, valid)
    if valid:
        note_monitor_lengths(cfg)
    try:
        return train(cfg, train_set, valid, init=ref, start=start, resume_from=resumed,
                     stop_after_steps=stop_after_steps)
    except ResumableFailure as e:  # the command line says whether there is a checkpoint to resume from
        newest = latest_complete_checkpoint(cfg.run_dir / STAGE / "checkpoints")
        e.checkpoint, e.checked = (str(newest) if newest else None), True
        raise


def note_monitor_lengths(cfg: Config) -> None:
    """Say, with metric.monitor=reward, when the validation outputs and the samples have other length limits: the
    monitor's reward and the training reward then differ for a reward that reads length."""
    if cfg.metric.monitor == "reward" and cfg.rl.samples_groups and \
            cfg.eval.max_new_tokens != cfg.rollout.max_new_tokens:
        log.info("rl: the validation monitor scores greedy outputs of up to eval.max_new_tokens=%d tokens by the "
                 "reward, the samples RL trains on are up to rollout.max_new_tokens=%d: a reward that reads length "
                 "scores the two differently", cfg.eval.max_new_tokens, cfg.rollout.max_new_tokens)


def rl_splits(cfg: Config) -> tuple[Sequence[Example], Sequence[Example]]:
    """The RL stage's training rows, and its validation rows (the first metric.monitor_size; none without a
    validation file). A row may lack its target where nothing of the run reads it (:func:`rl_target_use`): RL
    on sources alone, with a reward that reads no references; elsewhere the error says what reads it."""
    train = _labelled_where_read(cfg, "train", rl_target_use(cfg))
    if not cfg.path(cfg.data.valid).exists():
        return train, []
    readers = (reference_readers(cfg.reward) if cfg.metric.monitor == "reward" else
               [f"metric.monitor={cfg.metric.monitor} (the validation outputs scored against the references; "
                "metric.monitor=reward scores them by the reward, which may read none)"])
    return train, _labelled_where_read(cfg, "valid", readers)[: cfg.metric.monitor_size]


def rl_target_use(cfg: Config) -> list[str]:
    """What of an RL run reads each training row's target (or references), one entry each: the algorithm's
    (``Algorithm.target_use``) and the reward's terms that read references (:func:`reference_readers`)."""
    own = cfg.rl.unit.target_use(cfg.rl)
    files = cfg.rl.section() if cfg.rl.unit.data == "preferences" else None  # pairs from files: no reward scores
    readers = [] if files and (files.rank_lists or files.pairs or files.ratings) else reference_readers(cfg.reward)
    if readers and cfg.reward.terms == RewardConfig().terms:  # the user may not know there is a reward at all
        readers = [f"{readers[0]}, the default reward: set reward.terms, or give rlt2t.train a reward"]
    return ([own] if own else []) + readers


def _labelled_where_read(cfg: Config, split: str, readers: Sequence[str]) -> Sequence[Example]:
    """``split`` loaded, its targets required when ``readers`` (what reads them) is not empty: the error for a row
    without one then names them."""
    try:
        return load_split(cfg, split, require_target=bool(readers))
    except ValueError as e:
        if not readers or UNLABELED_HINT not in str(e):
            raise
        # instead of the generic hint (read it with --unlabeled ...): what reads the targets, and the way out
        why = (f"data.{split} needs targets in this run for {'; '.join(readers)}; RL trains on rows without targets "
               "when nothing reads them (docs/guides/rewards.md, \"Sources without targets\")")
        if isinstance(e, DataError):
            raise DataError(e.path, e.line, e.field, e.reason.replace(UNLABELED_HINT, why)) from None
        raise ValueError(str(e).replace(UNLABELED_HINT, why)) from None


BLEU_ORDER = 4
"""BLEU-4's longest n-gram: plain BLEU-4 (no smoothing, the task score's) is 0 for a text with fewer tokens."""
BLEU_SHORT_SHARE = 0.9
"""Share of rows without a reference of BLEU_ORDER tokens from which the reward's BLEU-4 part is dead weight."""


def warn_if_bleu_cannot_score(cfg: Config, rows: Sequence[Example]) -> None:
    """Warn when the reward holds BLEU-4 (a ``bleu4`` term, or the task score with a BLEU weight) while for nearly
    every row (``BLEU_SHORT_SHARE``) BLEU-4 is 0 whatever the candidate: no reference has 4 tokens (plain BLEU-4,
    the task score's, counts 4-grams; a reference scored against its own row, by the term's own tokenizer and
    smoothing, tells). Its share of the reward is then a constant that only shrinks the rest. (About half of the
    demo's rows are so: still a signal.) Not for an algorithm trained from preference files alone."""
    from rlt2t.common.metrics import get_metric

    if cfg.rl.unit.data == "preferences":
        return
    weighted = [t for t in cfg.reward.terms if isinstance(t, MetricTerm) and (t.name == "bleu4" or (
        t.name == "task_score" and t.params.get("bleu_weight", cfg.reward.bleu_weight) > 0))]
    sample = [e.refs for e in rows[:10_000] if e.refs]  # a sample is enough (a large Parquet file reads lazily)
    if not weighted or not sample:
        return
    bleu = get_metric("bleu4", **(weighted[0].params if weighted[0].name == "bleu4" else {}))
    longest = [max(refs, key=len) for refs in sample]
    dead = float((bleu.per_sample(longest, sample) == 0).mean())
    if dead >= BLEU_SHORT_SHARE:
        log.warning("rl: for %.0f%% of the training rows BLEU-4 is 0 whatever the candidate (no reference has %d "
                    "tokens): the BLEU-4 part of the reward (%s) gives almost nothing to learn from; with the task "
                    "score, set reward.bleu_weight=0 to score by CIDEr-D alone (metric.bleu_weight=0 for the "
                    "tables too); a bleu4 term, drop it or give it effective_order", 100 * dead, BLEU_ORDER,
                    ", ".join(f"{t.name} × {t.weight:g}" for t in weighted))


def _tokenizer_from(cfg: Config, start: Path) -> None:
    """A run started elsewhere (``--init`` another run's checkpoint, run.dir a new directory) has no tokenizer of
    its own, which the rollout workers build their model with, and eval, export and predict read later: the
    tokenizer saved with its start checkpoint becomes the run's. Not with model.path: its own tokenizer is the one
    every command reads."""
    if cfg.tokenizer.path or cfg.model.path or cfg.tokenizer_dir.is_dir() or not has_tokenizer(start):
        return  # (model.path: its own tokenizer is what every command reads)
    with atomic_directory(cfg.tokenizer_dir) as tmp:  # a kill leaves none, not half of one
        save_tokenizer(load_tokenizer(start), tmp)
    log.info("rl: the run had no tokenizer: %s is the one saved with %s", cfg.tokenizer_dir, start)


def prepare_sft(cfg: Config) -> Path:
    """Data, tokenizer, pretraining and SFT, each resumed or skipped when already done; returns the SFT
    checkpoint that later stages start from (the demo and the quality benchmark share this). A run.dir that
    holds none of these outputs yet gets the demo's marker (``mark_demo_run``)."""
    mark_demo_run(cfg)
    if not cfg.path(cfg.data.train).exists():
        make_synthetic_data(cfg)
    if not cfg.tokenizer_dir.is_dir() and not (cfg.model.path and tokenizer_source(cfg.model.path, None)):
        build_tokenizer_job(cfg)  # (a pretrained model.path brings its own)
    if cfg.pretrain.enabled:
        pretrain_job(cfg, resume=True)
    sft_job(cfg, resume=True)
    return sft_start(cfg)
