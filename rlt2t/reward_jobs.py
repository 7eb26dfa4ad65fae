"""Learned-reward stages of a run, wired from the one config tree (`rlt2t reward-model train`,
`rlt2t classifier train`); they write under ``run.dir``:

    reward_model/checkpoints/epoch-0001 ...   reward models (a Hugging Face backbone + head + spec)
    classifier/checkpoints/epoch-0001 ...     sequence classifiers
    logs/reward_model/, logs/classifier/      metrics.jsonl, TensorBoard events, curves.png
"""

from __future__ import annotations

import logging
import random

from rlt2t.common.checkpoint import read_checkpoint, resolve_model_dir, resume_point
from rlt2t.common.config import Config
from rlt2t.common.metrics import saved_id2label
from rlt2t.common.preferences import check_preference_texts, load_preferences, split_by_source
from rlt2t.common.reward_model import init_reward_model, load_reward_model, packaged_or_path
from rlt2t.common.tokenization import load_tokenizer, text_checker
from rlt2t.jobs import save_run_config, sft_start
from rlt2t.learner.classifier import check_labels, init_classifier, read_labelled, train_classifier
from rlt2t.learner.reward_model import train_reward_model
from rlt2t.learner.trainer import StageResult

log = logging.getLogger("rlt2t.reward_jobs")


def reward_model_job(cfg: Config, resume: bool = False) -> StageResult:
    """Train a reward model on ``reward_model.rank_lists / pairs / ratings`` from ``reward_model.init`` (default:
    the run's best SFT checkpoint); ``resume`` continues the newest complete checkpoint."""
    rm = cfg.reward_model
    save_run_config(cfg, "reward_model")
    groups = load_preferences([cfg.path(p) for p in rm.rank_lists], [cfg.path(p) for p in rm.pairs],
                              [cfg.path(p) for p in rm.ratings], key="reward_model")
    if not groups:
        given = [*rm.rank_lists, *rm.pairs, *rm.ratings]
        if given:  # files, but not one source with two candidates people told apart
            raise ValueError(f"reward_model: no preference pairs in {', '.join(given)} (empty files, or every "
                             "source's candidates ranked or rated alike)")
        raise ValueError("reward_model: no preferences; give reward_model.rank_lists, .pairs or .ratings "
                         "(--rank-lists / --pairs / --ratings)")
    train, valid = split_by_source(groups, rm.valid_fraction, cfg.run.seed)
    pairs = sum(len(g.pairs) for g in groups)
    log.info("reward model: %d preference groups (%d pairs): %d train, %d held out", len(groups), pairs, len(train),
             len(valid))
    if rm.valid_fraction > 0 and not valid:
        log.warning("reward model: reward_model.valid_fraction=%s held out no source (too few sources); no "
                    "held-out pair accuracy", rm.valid_fraction)
    out_dir = cfg.path(rm.out)
    latest = resume_point(out_dir / "checkpoints", resume, elsewhere="use another output directory")
    if latest is not None:
        model = load_reward_model(latest, dropout=rm.dropout)
        info = read_checkpoint(latest)
    else:
        init = packaged_or_path(str(cfg.path(rm.init)), "reward_model.init") if rm.init else sft_start(
            cfg, "pass --init (reward_model.init) with the backbone")
        log.info("reward model: backbone from %s", init)
        model = init_reward_model(init, max_source_len=rm.max_source_len, max_candidate_len=rm.max_candidate_len,
                                  dropout=rm.dropout, seed=cfg.run.seed)
        info = None
    check_preference_texts(groups, text_checker(model.tokenizer))  # the backbone's token rule, as the server's
    model.train()
    return train_reward_model(model, train, valid, rm, cfg.run, out_dir, resume_from=info)


def classifier_job(cfg: Config, resume: bool = False) -> StageResult:
    """Train a sequence classifier on ``classifier.train`` (JSONL ``text``, ``label``) from ``classifier.init``."""
    c = cfg.classifier
    save_run_config(cfg, "classifier")
    if not c.train:
        raise ValueError("classifier.train: give the labelled JSONL (`text`, `label` per line)")
    rows = read_labelled(cfg.path(c.train))
    if c.valid:
        valid = read_labelled(cfg.path(c.valid))
        train = rows
    else:
        shuffled = list(rows)
        random.Random(cfg.run.seed).shuffle(shuffled)
        cut = round(len(shuffled) * c.valid_fraction)
        valid, train = shuffled[:cut], shuffled[cut:]
    labels = list(c.labels) or sorted({r.label for r in rows})
    if len(labels) < 2:
        raise ValueError(f"classifier: a classifier needs >= 2 labels, got {labels} (classifier.labels or the data)")
    check_labels(rows, labels, str(cfg.path(c.train)))
    if c.valid:
        check_labels(valid, labels, str(cfg.path(c.valid)))
    out_dir = cfg.path(c.out)
    latest = resume_point(out_dir / "checkpoints", resume, elsewhere="use another output directory")
    if latest is not None:
        model_dir, info = latest, read_checkpoint(latest)
        from_config = [v for _, v in sorted(saved_id2label(model_dir).items())]
        if from_config != labels:
            raise ValueError(f"classifier: the checkpoint {latest} has labels {from_config}, the data {labels}")
        model = init_classifier(model_dir, labels)
    else:
        if not c.init:
            raise ValueError("classifier.init: give a local encoder or sequence-classification directory (--init)")
        model_dir, info = resolve_model_dir(packaged_or_path(str(cfg.path(c.init)), "classifier.init")), None
        model = init_classifier(model_dir, labels)
    log.info("classifier: %d train / %d held-out texts, labels %s, backbone %s", len(train), len(valid), labels,
             model_dir)
    return train_classifier(model, load_tokenizer(model_dir), train, valid, labels, c, cfg.run, out_dir,
                            resume_from=info)


