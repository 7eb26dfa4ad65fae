"""Efficacy: which RL algorithm raises the task score above continued SFT, over seeds and on two tasks.

    python bench/algorithms.py --task synth      [--seeds 1,2,3] [--arms continued_sft,rank,scst,...] [--workdir DIR]
    python bench/algorithms.py --task docstrings [...]

For each seed the WHOLE pipeline is rerun (run.seed: pretraining and SFT initialisation, order and dropout,
then RL sampling), so no result hinges on one lucky SFT checkpoint. From that seed's SFT checkpoint every
arm trains for the same number of learner steps on the same sources, sampling the same number of
candidates per source (rollout.num_samples):

  continued_sft  rl.algorithm=rank with rl.rank.loss_weight=0: CE on the gold targets only
  rank           CE + 0.2·pairwise rank loss (rlt2t's original, sampling as it did: top-k 3, temperature 0.8)
  scst rloo grpo group policy gradients; ppo a2c nlpo: token-level actor-critic (docs/design.md)
  trpo           token-level actor-critic with one natural-gradient step per batch in a KL trust region
  dpo            offline preference optimisation: one pair per source, the best over the worst of
                 rl.dpo.sampled_candidates samples of the SFT checkpoint by the reward, then rl.epochs passes
                 over the pairs (variants: dpo:ipo, the IPO loss; dpo:e6 / e9 / e12, that many epochs, to match
                 another arm's wall time; dpo:e6lr2e-5, 6 epochs at rl.lr=2e-5)

Reported per arm, mean ± sample std over seeds: the validation task score after each RL epoch (greedy, the
first metric.monitor_size validation examples, as the job logs it), the test task score of the last
checkpoint (greedy, whole test split), the KL to the SFT checkpoint (nats per sequence, from 4 samples per
test source of the final policy at temperature 1), and the wall time; and, per algorithm, the paired
difference (seed by seed) to what likelihood training reaches: of the SFT checkpoint itself and the
continued-SFT arms (with variants in --arms, such as continued_sft:lr5e-5), the one with the best mean
validation score, the one a user would keep; its ratio to the std of the differences, and the relative gain.
On the synthetic task the two oracles of rlt2t.common.synth show how far each arm moves from the
likelihood-optimal phrasing towards the metric-optimal one. On the docstring task, --heldout N also scores the
SFT checkpoint and every arm on N pairs that none of the splits drew (the 800-row test split's noise is about
the size of RL's effect there). The SFT checkpoint's headroom (test, and held-out with --heldout): the task
score of its greedy decode against a reference-free choice among that decode and 6 samples (the consensus, a
minimum-Bayes-risk pick), against one sample, and against the best of them by the reference (an oracle).
--rl-split F holds a fraction F of the training sources (with all their rows) back from SFT, and every arm trains
on those instead: RL on sources the checkpoint has not memorised; `continued_sft:replay` then continues SFT on
all training rows, old and new.

Tasks: `synth` (the demo's synthetic report task, ids tokenizer) and `docstrings` (a function's name and
arguments → the summary line its authors wrote, from the installed packages: human-written English, a
byte-level BPE tokenizer; rlt2t data docstrings). `wordnet` (WordNet definition modelling) is there too, but
a from-scratch `small` model only reaches a validation CIDEr-D of about 0.09 on it in 8 epochs, too weak a
start to compare RL algorithms on.

Everything is resumable: a --workdir that holds finished stages or arms reuses them (an arm's result is
cached in <arm>/result.json). Saves bench/results/algorithms_<task>.json and .png. A seed whose SFT checkpoint
writes the same few texts whatever the source is flagged in the output (its arms compare nothing). `--pool`
merges saved results of the same settings on disjoint seeds (a confirmation run beside the first) into one.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import RESULTS, save  # noqa: E402

from rlt2t.common.candidates import stable_seed  # noqa: E402
from rlt2t.common.collate import collate_seq2seq, encode_texts  # noqa: E402
from rlt2t.common.config import Config, load_config  # noqa: E402
from rlt2t.common.data import load_examples, reference_sets, write_examples  # noqa: E402
from rlt2t.common.io import atomic_open, atomic_write_json, atomic_write_jsonl  # noqa: E402
from rlt2t.common.metrics import get_metric  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.sampling import sample_candidates  # noqa: E402
from rlt2t.common.scoring import sequence_logprobs  # noqa: E402
from rlt2t.common.tracking import setup_logging  # noqa: E402
from rlt2t.jobs import (  # noqa: E402
    eval_job,
    load_split,
    make_docstring_data,
    make_docstring_names_data,
    make_wordnet_data,
    prepare_sft,
    rl_job,
)

log = logging.getLogger("bench.algorithms")

ALL_ARMS = ("continued_sft", "rank", "scst", "rloo", "grpo", "ppo", "a2c", "nlpo", "dpo", "trpo")

# Defaults the saved results were measured with, before the demo's changed (CHANGELOG: sft.monitor, the
# monitor's size, the synthetic splits, the preset family, SFT's early stop, SFT batches grouped by length, K),
# pinned so that a rerun measures what they did. The synthetic task itself moved to generator version 3, which
# no setting brings back.
_MEASURED_WITH = ["model.family=bart", "sft.monitor=metric", "metric.monitor_size=200", "sft.patience=0",
                  "sft.group_by_length=false", "rollout.num_samples=6"]
_SPLITS_BEFORE = ["synth.valid_fraction=0.05", "synth.test_fraction=0.05"]

# The tasks' shared stages. The synthetic task is the demo's; WordNet definitions need a subword tokenizer,
# shorter limits and more SFT (its targets are varied natural language).
TASK_SETTINGS = {
    # 12 SFT epochs run past the validation peak (about epoch 3): the stage keeps its best checkpoint, and from
    # there likelihood training drifts towards phrasing A, as a converged SFT model does (common.synth).
    "synth": ["synth.size=4000", "pretrain.max_steps=150", "sft.epochs=12"],
    "wordnet": ["tokenizer.kind=subword", "tokenizer.vocab_size=4000", "data.max_source_len=48",
                "data.max_target_len=32", "rollout.max_new_tokens=32", "eval.max_new_tokens=32",
                "pretrain.max_steps=300", "sft.epochs=8", "sft.lr=1e-3"],
    # 16 SFT epochs: with 6, validation was still rising by about 0.08 an epoch on every seed, so continued SFT
    # still had likelihood gains to collect that RL does not target; the stage keeps its best checkpoint.
    "docstrings": ["tokenizer.kind=subword", "tokenizer.vocab_size=4000", "data.max_source_len=48",
                   "data.max_target_len=32", "rollout.max_new_tokens=32", "eval.max_new_tokens=32",
                   "pretrain.max_steps=300", "sft.epochs=16", "sft.lr=1e-3"],
    # Several references per source (a function's name → every summary of that name): the docstring task's
    # settings, and about 250 validation and 400 test names of the 3,071 with two or more summaries.
    "docstring_names": ["tokenizer.kind=subword", "tokenizer.vocab_size=4000", "data.max_source_len=48",
                        "data.max_target_len=32", "rollout.max_new_tokens=32", "eval.max_new_tokens=32",
                        "pretrain.max_steps=300", "sft.epochs=16", "sft.lr=1e-3", "synth.valid_fraction=0.08",
                        "synth.test_fraction=0.13"],
}
for _task, _settings in TASK_SETTINGS.items():
    _settings[:0] = _MEASURED_WITH + (_SPLITS_BEFORE if _task != "docstring_names" else [])


# Arm variants, `<algorithm>:<variant>`: the same algorithm with another rollout backend (what an int8
# CTranslate2 sampler costs or gains against a float32 one, with truncated importance weights), or a gentler
# update (a quarter of the learning rate; a 4x KL coefficient), rank RL's sampling (top-k 3, temperature 0.8),
# LoRA adapters (r = 8) instead of full fine-tuning, or more samples per source.
VARIANTS = {
    "ct2_int8": ["rollout.backend=ct2", "rollout.ct2_compute_type=int8"],
    "ct2_float32": ["rollout.backend=ct2", "rollout.ct2_compute_type=float32"],
    "lr5e-5": ["rl.lr=5e-5"],
    "kl0.2": ["rl.kl.coef=0.2"],
    # An adaptive β aiming at 1 nat per sequence (GRPO's KL at 32 steps on the several-reference task), with a
    # horizon short enough to move β within a 32-step run (up to ±3.8 % a step at 192 sequences a step).
    "klt1": ["rl.kl.target=1", "rl.kl.horizon=1000"],
    # A likelihood term beside the policy gradient (rl.pg.sft_coef): CE on the gold targets, weighted 0.25 or 1.
    "sft0.25": ["rl.pg.sft_coef=0.25"],
    "sft1": ["rl.pg.sft_coef=1"],
    "topk3": ["rollout.top_k=3", "rollout.temperature=0.8"],  # sampling closer to the greedy decode, as rank's
    "lora": ["model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16"],  # adapters only, same steps
    "k16": ["rollout.num_samples=16"],  # 16 samples per source instead of 6: a less noisy advantage, same sources
    # GRPO's advantage scale (rl.pg.grpo_scale): one std over the batch (the default since 2026-11-27: a source
    # whose K rewards differ by a hair, all near 0 on sources the model cannot write yet, stays near 0), or each
    # source's own std, the default before (every `grpo` reading saved before that date; `groupstd` reruns it).
    "batchstd": ["rl.pg.grpo_scale=batch"],
    "groupstd": ["rl.pg.grpo_scale=group"],
    # With --rl-split: the arm trains on every training row (the SFT's and the held-back ones) instead of the
    # held-back rows only, as a user who gets new labelled sources would continue SFT on old and new together.
    "replay": [],
    # DPO: the IPO loss; more passes over its pairs (a DPO step costs a fraction of a sampling arm's, so equal
    # wall time means more epochs: one validation point each).
    "ipo": ["rl.dpo.loss=ipo"],
    "e6": ["rl.epochs=6"],
    "e9": ["rl.epochs=9"],
    "e12": ["rl.epochs=12"],
    "e6lr2e-5": ["rl.epochs=6", "rl.lr=2e-5"],  # and a tenth of the policy gradients' learning rate
}


def arm_overrides(arm: str) -> list[str]:
    """What distinguishes an arm; everything else (steps, sources, K, sampling) is shared."""
    if ":" in arm:
        algorithm, variant = arm.split(":", 1)
        return [*arm_overrides(algorithm), *VARIANTS[variant]]
    if arm == "continued_sft":
        return ["rl.algorithm=rank", "rl.rank.loss_weight=0"]
    if arm == "rank":  # rank RL samples as the original did: top-k 3, temperature 0.8
        return ["rl.algorithm=rank", "rollout.top_k=3", "rollout.temperature=0.8"]
    return [f"rl.algorithm={arm}"]


def base_config(task: str, workdir: Path, seed: int, args: argparse.Namespace, *extra: str) -> Config:
    """One seed's shared stages (data, tokenizer, pretraining, SFT) under <workdir>/<task>/seed<s>/base."""
    return load_config(overrides=[
        f"run.dir={workdir / task / f'seed{seed}' / 'base'}", "run.progress=false", f"run.seed={seed}",
        *TASK_SETTINGS[task], *args.base_override, *extra])


def arm_config(base: Config, arm: str, args: argparse.Namespace, sources: Path | None = None) -> Config:
    """An arm's config: its own run dir beside the base, the base's data and tokenizer; RL on ``sources``
    instead of the SFT training split when given (--fresh-sources: the run dir is named after them too, so a
    reused --workdir never mistakes one reading's cached arm for the other's)."""
    name = arm.replace(":", "-") + (f"-{sources.stem}" if sources else "")
    if arm.endswith(":replay"):
        if sources is None or sources.name != "train_rl.jsonl":
            raise ValueError(f"--arms {arm}: the replay variant needs --rl-split (it adds the held-back rows to SFT's)")
        sources = sources.with_name("train.jsonl")
    return load_config(overrides=[
        f"run.dir={base.run_dir.parent / name}", "run.progress=false", f"run.seed={base.run.seed}",
        # the base's settings: the model the arm's workers build must be the one its checkpoints hold
        *TASK_SETTINGS[args.task], *args.base_override, f"tokenizer.path={base.tokenizer_dir}",
        f"data.train={sources or base.path(base.data.train)}", f"data.valid={base.path(base.data.valid)}",
        f"data.test={base.path(base.data.test)}", "eval.split=test",
        f"rl.epochs={args.rl_epochs}", f"rl.train_subset={args.train_subset}", f"rl.batch_size={args.batch_size}",
        *arm_overrides(arm), *args.override])


def valid_curve(cfg: Config) -> list[dict[str, float]]:
    """The arm's per-epoch validation rows (kind "valid"; the last row wins for an epoch logged twice)."""
    by_epoch = {}
    for line in (cfg.run_dir / "logs" / "rl" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "valid":
            by_epoch[int(row["epoch"])] = {k: row[k] for k in ("step", "monitor", "task_score")}
    return [by_epoch[e] for e in sorted(by_epoch)]


def train_means(cfg: Config) -> dict[str, float]:
    """Means over the run's logged training rows of the policy-gradient diagnostics (when logged)."""
    rows = [json.loads(x) for x in (cfg.run_dir / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind", "train") == "train"]
    keys = ("kl_seq", "reward_mean", "sampler_ratio_max_dev", "clip_fraction", "entropy", "step_s")
    return {k: statistics.fmean(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)}


def _draws(cfg: Config, policy, examples: list, samples: int, tag: str):
    """Per chunk of 32 examples: (its collated batch, ``samples`` draws per source), drawn at temperature 1 from
    the whole vocabulary with generators seeded by (run seed, ``tag``, example id, draw)."""
    for first in range(0, len(examples), 32):
        chunk = examples[first : first + 32]
        ids, _ = encode_texts(policy.tokenizer, [e.source for e in chunk], cfg.data.max_source_len)
        batch = collate_seq2seq(ids, None, policy.tokenizer.pad_token_id)
        gens = [torch.Generator().manual_seed(stable_seed(cfg.run.seed, tag, e.id, j)) for e in chunk
                for j in range(samples)]
        yield batch, sample_candidates(policy.model, batch["input_ids"], batch["attention_mask"], samples, 0, 1.0,
                                       cfg.rollout.max_new_tokens, gens)


@torch.no_grad()
def kl_to_start(cfg: Config, final: Path, start: Path, samples: int = 4) -> float:
    """KL(final || start) in nats per sequence: the mean of log p_final(y) - log p_start(y) over ``samples``
    draws y of the final policy (temperature 1, whole vocabulary) per test source."""
    examples = load_split(cfg, "test", require_target=False)
    pf = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=final)
    ps = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=start)
    pf.model.eval()
    ps.model.eval()
    total, n = 0.0, 0
    for batch, rows in _draws(cfg, pf, examples, samples, "kl"):
        tokens = [r.token_ids for r in rows]
        lp_start = sequence_logprobs(ps.model, batch["input_ids"], batch["attention_mask"], tokens, samples)
        for r, ls in zip(rows, lp_start, strict=True):
            total += sum(r.logprobs) - sum(ls)
            n += 1
    return total / max(n, 1)


def run_arm(cfg: Config, sft_ckpt: Path) -> dict[str, Any]:
    """The RL job from the SFT checkpoint (cached once finished), then test score and KL of its last checkpoint."""
    cached = cfg.run_dir / "result.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    t0 = time.perf_counter()
    result = rl_job(cfg, resume=True, init=sft_ckpt)
    seconds = time.perf_counter() - t0
    curve = valid_curve(cfg)
    if len(curve) != cfg.rl.epochs:
        raise RuntimeError(f"{cfg.run_dir}: {len(curve)} validation rows for {cfg.rl.epochs} epochs")
    test = eval_job(cfg, checkpoint=result.checkpoint, label="last")
    out = {"seconds": round(seconds, 1), "steps": result.steps, "checkpoint": str(result.checkpoint),
           "valid": curve, "test": {k: test[k] for k in ("task_score", "cider_d", "bleu4")},
           "kl_to_start": kl_to_start(cfg, result.checkpoint, sft_ckpt), "train": train_means(cfg)}
    atomic_write_json(cached, out)
    return out


def heldout_split(base: Config, rows: int) -> Path:
    """Docstring task: ``rows`` pairs of the installed packages that none of the run's splits drew, a second and
    larger test set (on the 800-row test split the evaluation noise is about the size of RL's effect). Every seed
    draws the same splits, so one file beside the seeds serves them all."""
    return _outside_splits(base, base.run_dir.parent.parent / f"heldout{rows}.jsonl", rows, seed=11, avoid=[],
                           flag="--heldout")


def fresh_sources(base: Config, rows: int, heldout: Path | None) -> Path:
    """Docstring task: ``rows`` pairs outside the run's splits and the held-out rows, for the RL arms to train on
    instead of the SFT training split. After 16 SFT epochs the model reproduces its training references (the
    reward of RLOO's samples there is 2-6x the held-out score of its greedy decode), so a policy gradient there
    mostly relearns those references; on sources SFT never saw, the reward says how it writes for new inputs."""
    name = f"fresh{rows}" + (f"-outside-{heldout.stem}" if heldout else "")  # which rows it avoids, too
    return _outside_splits(base, base.run_dir.parent.parent / f"{name}.jsonl", rows, seed=13,
                           avoid=[heldout] if heldout else [], flag="--fresh-sources")


def rl_split(train: Path, fraction: float, seed: int = 17) -> tuple[Path, Path]:
    """--rl-split: the training split's sources divided in two, ``fraction`` of them (every row of a source goes
    with it: a several-reference source's references stay together) for the RL arms and the rest for SFT, written
    once beside ``train`` as ``train_sft.jsonl`` and ``train_rl.jsonl``. The pipeline's SFT then trains on the
    first only, and every arm, continued SFT included, on the second: sources the SFT checkpoint never saw, with
    their references, the same rows for every arm. After a converged SFT the model reproduces its training
    references (a policy gradient there mostly relearns them); on held-back sources the reward says how it
    writes for new inputs, the test split's case."""
    if not 0 < fraction < 1:
        raise ValueError(f"--rl-split {fraction}: give the fraction of training sources held back for RL, in (0, 1)")
    sft_path, rl_path = train.with_name("train_sft.jsonl"), train.with_name("train_rl.jsonl")
    if sft_path.is_file() and rl_path.is_file():
        return sft_path, rl_path
    rows = load_examples(train)
    sources = sorted({e.source for e in rows})
    random.Random(seed).shuffle(sources)
    held = set(sources[: round(fraction * len(sources))])
    if not held or len(held) == len(sources):
        raise ValueError(f"--rl-split {fraction}: {len(sources)} training sources leave one side empty")
    write_examples(rl_path, (e for e in rows if e.source in held))
    write_examples(sft_path, (e for e in rows if e.source not in held))
    return sft_path, rl_path


def _outside_splits(base: Config, path: Path, rows: int, *, seed: int, avoid: list[Path], flag: str) -> Path:
    """``rows`` docstring pairs drawn (with ``seed``) from those outside the run's splits and the files ``avoid``,
    written once to ``path``."""
    from rlt2t.common.docstrings import PACKAGES, docstring_pairs, package_dirs

    if not path.is_file():
        used = {e.id for split in ("train", "valid", "test") for e in load_split(base, split)}
        used |= {json.loads(line)["id"] for f in avoid for line in f.read_text().splitlines() if line.strip()}
        pool = [r for r in docstring_pairs(package_dirs(PACKAGES)) if r["id"] not in used]
        if len(pool) < rows:
            raise ValueError(f"{flag} {rows}: only {len(pool)} pairs are left outside the run's splits")
        atomic_write_jsonl(path, random.Random(seed).sample(pool, rows))
    return path


def on_heldout(cfg: Config, heldout: Path) -> Config:
    """``cfg`` with the held-out rows as its test split."""
    held = cfg.model_copy(deep=True)
    held.data.test = str(heldout)
    return held


def heldout_score(cfg: Config, checkpoint: Path, heldout: Path, label: str) -> float:
    """Greedy task score of ``checkpoint`` on the held-out rows (cached in the run's eval/ directory)."""
    out = cfg.run_dir / "eval" / f"{label}-test.json"
    if not out.is_file():
        eval_job(on_heldout(cfg, heldout), checkpoint=checkpoint, label=label)
    return float(json.loads(out.read_text())["task_score"])


def headroom(cfg: Config, checkpoint: Path, examples: list, label: str, samples: int = 6) -> dict[str, float]:
    """How much a metric-aware choice among the SFT checkpoint's own outputs gains over its greedy decode.

    Per source: the greedy decode and ``samples`` draws at temperature 1 (whole vocabulary). Task scores of the
    greedy decodes, of the first draws, of the consensus choice among all of them (the candidate with the
    highest mean CIDEr-D against the others, ``rlt2t.common.rerank.consensus_scores``: a minimum-Bayes-risk
    decode under the model's own uncertainty, which needs no reference), and of the best one by its sentence
    task score against the reference (an oracle pick among these candidates). The consensus gain is what
    choosing differently among the policy's own outputs finds source by source; a policy gradient can find more
    where one fix serves many sources (the synthetic task's phrasing). Ties go to the greedy decode. Cached in
    the run's eval/ directory."""
    import numpy as np

    from rlt2t.common.metrics import CiderD, DocumentFrequency
    from rlt2t.common.rerank import consensus_scores
    from rlt2t.learner.evaluate import generate

    out_path = cfg.run_dir / "eval" / f"{label}-headroom.json"
    if out_path.is_file():
        return json.loads(out_path.read_text())
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=checkpoint)
    policy.model.eval()
    sources = [e.source for e in examples]
    greedy = generate(policy, sources, max_new_tokens=cfg.eval.max_new_tokens, max_source_len=cfg.data.max_source_len)
    drawn: list[list[str]] = []
    for _, rows in _draws(cfg, policy, examples, samples, "headroom"):  # sampling runs without autograd
        texts = policy.decode([r.token_ids for r in rows])
        drawn += [texts[i : i + samples] for i in range(0, len(texts), samples)]
    refs = [list(e.refs) for e in examples]
    # CIDEr-D's document frequencies: the split's references for scoring (as `rlt2t eval` does; a per-source
    # call would take them from one reference alone), the training references for the consensus (as predict does).
    metric = get_metric("task_score", bleu_weight=cfg.metric.bleu_weight, sigma=cfg.metric.cider_sigma,
                        df=DocumentFrequency.from_references(refs))
    pools = [[g, *d] for g, d in zip(greedy, drawn, strict=True)]
    train = reference_sets(load_split(cfg, "train"))
    agree = CiderD(sigma=cfg.metric.cider_sigma, df=DocumentFrequency.from_references(train))
    consensus = [pool[int(np.argmax(consensus_scores(pool, range(len(pool)), agree)))] for pool in pools]
    oracle = [pool[int(np.argmax(metric.per_sample(pool, [ref] * len(pool))))] for pool, ref in zip(pools, refs,
                                                                                                     strict=True)]
    result = {"greedy": metric.corpus(greedy, refs), "sample": metric.corpus([d[0] for d in drawn], refs),
              "consensus": metric.corpus(consensus, refs), "oracle_best": metric.corpus(oracle, refs),
              "candidates": samples + 1, "rows": len(examples)}
    atomic_write_json(out_path, result)
    return result


def oracle_scores(cfg: Config) -> dict[str, float]:
    """Test task score of the synthetic task's two oracles (likely phrasing A, metric-preferred B)."""
    from rlt2t.common.synth import build_spec, oracle_diagnosis

    spec = build_spec(cfg.tokenizer.num_data_tokens)
    test = load_split(cfg, "test")
    metric = get_metric("task_score", bleu_weight=cfg.metric.bleu_weight, sigma=cfg.metric.cider_sigma)
    refs = [[e.target] for e in test]
    return {name: metric.corpus([oracle_diagnosis(spec, e.source, k) for e in test], refs)
            for name, k in (("oracle_likely_A", 0), ("oracle_metric_B", 1))}


def phrasings(cfg: Config, label: str) -> dict[str, float]:
    """Synthetic task: of the concepts the test predictions of ``label`` name, the share phrased A (likelihood's
    choice) and B (one of the suffix-sharing phrasings the metric prefers; key ``B_or_C`` as in results saved by
    generator version 2, where there were two), and the share of outputs that open with the prefix token
    (``PREFIX_PROB`` of the references do)."""
    from rlt2t.common.synth import build_spec, phrasing_usage

    path = cfg.run_dir / "eval" / f"{label}-test.predictions.jsonl"
    outputs = [json.loads(line)["prediction"] for line in path.read_text().splitlines()]
    u = phrasing_usage(build_spec(cfg.tokenizer.num_data_tokens), outputs)
    said = max(u["A"] + u["B"] + u["other"], 1)
    return {"A": u["A"] / said, "B_or_C": u["B"] / said, "prefix": u["prefix"] / max(u["outputs"], 1)}


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarize(sft: dict[int, dict[str, Any]], arms: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    # A seed whose SFT checkpoint collapsed (`_valid_readings`) compares nothing: it is left out and named.
    excluded = [s for s in sorted(sft) if sft[s].get("collapsed")]
    seeds = [s for s in sorted(sft) if s not in excluded]
    if not seeds:
        raise ValueError(f"every seed's SFT checkpoint collapsed ({excluded}): nothing to compare")
    out: dict[str, Any] = {"sft": {k: mean_std([sft[s][k] for s in seeds]) for k in sft[seeds[0]]
                                   if k.endswith("task_score")}, "excluded_seeds": excluded}
    for arm, runs in arms.items():
        out[arm] = {"valid_task_score": mean_std([runs[s]["valid"][-1]["task_score"] for s in seeds]),
                    "test_task_score": mean_std([runs[s]["test"]["task_score"] for s in seeds]),
                    "kl_to_start": mean_std([runs[s]["kl_to_start"] for s in seeds]),
                    "seconds": mean_std([runs[s]["seconds"] for s in seeds])}
        if all("heldout_task_score" in runs[s] for s in seeds):
            out[arm]["heldout_task_score"] = mean_std([runs[s]["heldout_task_score"] for s in seeds])
    for split in ("test", "heldout"):  # the SFT checkpoint's headroom (see headroom())
        if all(f"headroom_{split}" in sft[s] for s in seeds):
            rows = [sft[s][f"headroom_{split}"] for s in seeds]
            h = {k: mean_std([r[k] for r in rows]) for k in ("greedy", "sample", "consensus", "oracle_best")}
            h["consensus_gain"] = mean_std([r["consensus"] / r["greedy"] - 1 for r in rows])
            out["sft"][f"headroom_{split}"] = h
    for name, runs in (("sft", sft), *arms.items()):  # synthetic task: phrasing shares, SFT row included
        if all("phrasings" in runs[s] for s in seeds):
            out[name]["phrasings"] = {k: mean_std([runs[s]["phrasings"][k] for s in seeds])
                                      for k in runs[seeds[0]]["phrasings"]}
    # The baseline: what likelihood training reaches, as a user would keep it. Of the SFT checkpoint itself
    # (continued SFT stopped at step 0) and the continued-SFT arms (variants such as continued_sft:lr5e-5
    # included), the one with the best mean validation score; every other arm is compared with it seed by seed.
    # Past its validation peak continued SFT can lose score, and beating a baseline that did is no gain. The
    # target (> 2 σ and >= 10 % on test) must hold against each of them, so that it never hinges on which one
    # the validation subset's noise chose.
    start = {s: {"valid": [{"task_score": sft[s]["valid_task_score"]}],
                 "test": {"task_score": sft[s]["test_task_score"]},
                 **({"heldout_task_score": sft[s]["heldout_task_score"]} if "heldout_task_score" in sft[s] else {})}
             for s in seeds}
    # Without a continued-SFT arm the checkpoint is the only candidate: the paired differences are against it,
    # and there is no verdict (the target asks for continued SFT too).
    candidates = {"sft": start, **{arm: runs for arm, runs in arms.items() if arm.split(":")[0] == "continued_sft"}}
    baseline = max(candidates, key=lambda arm: out[arm]["valid_task_score"]["mean"])
    out["baseline"], out["baseline_candidates"] = baseline, list(candidates)
    splits = {"valid": lambda r: r["valid"][-1]["task_score"], "test": lambda r: r["test"]["task_score"],
              "heldout": lambda r: r["heldout_task_score"]}

    def paired(runs: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]], split: str) -> dict[str, Any]:
        get = splits[split]
        diffs = [get(runs[s]) - get(base[s]) for s in seeds]
        d = mean_std(diffs)
        ref = statistics.fmean(get(base[s]) for s in seeds)
        d["sigmas"] = d["mean"] / d["std"] if d["std"] > 0 else None
        d["relative"] = d["mean"] / ref if ref else None
        d["per_seed"] = diffs
        return d

    def meets_target(d: dict[str, Any]) -> bool:
        return bool(d["sigmas"] is not None and d["sigmas"] > 2 and d["relative"] >= 0.10)

    for arm, runs in arms.items():
        if arm == baseline:
            continue
        for split in splits:
            if split != "heldout" or ("heldout_task_score" in out[arm] and "heldout_task_score" in out[baseline]):
                out[arm][f"paired_diff_{split}"] = paired(runs, candidates[baseline], split)
        if arm not in candidates and len(candidates) > 1:
            each = {name: paired(runs, base, "test") for name, base in candidates.items()}
            out[arm]["paired_diff_test_each"] = {name: {k: d[k] for k in ("mean", "std", "sigmas", "relative")}
                                                 for name, d in each.items()}
            out[arm]["beats_sft_on_test"] = all(meets_target(d) for d in each.values())
    return out


def plot(path: Path, task: str, sft: dict[int, dict[str, Any]], arms: dict[str, dict[int, dict[str, Any]]]) -> None:
    """Validation task score per RL epoch (0 = the SFT checkpoint), mean ± std over seeds per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (arm, runs) in enumerate(arms.items()):
        curves = np.array([[sft[s]["valid_task_score"]] + [row["task_score"] for row in runs[s]["valid"]]
                           for s in sorted(runs)])
        epochs = np.arange(curves.shape[1])
        mean = curves.mean(0)
        std = curves.std(0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        color = plt.cm.tab10(i)
        ax.plot(epochs, mean, marker="o", color=color, label=f"{arm} ({len(curves)} seeds)",
                linewidth=2.5 if arm.startswith("continued_sft") else 1.5,
                linestyle="--" if arm.startswith("continued_sft") else "-")
        ax.fill_between(epochs, mean - std, mean + std, color=color, alpha=0.12)
    ax.set_xlabel("RL epoch (0 = the SFT checkpoint)")
    ax.set_ylabel("validation task score (greedy)")
    ax.set_title(f"RL algorithms vs continued SFT, {task} task (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def print_summary(task: str, seeds: list[int], rl_epochs: int, train_subset: int, sft: dict[int, dict[str, Any]],
                  arms: list[str], oracles: dict[str, float], summary: dict[str, Any]) -> None:
    """The benchmark's table on stdout: each arm's scores and its paired difference to the baseline."""
    seeds = [s for s in seeds if s not in summary.get("excluded_seeds", [])]
    print(f"\n{task}: task score, mean ± std over seeds {seeds} ({rl_epochs} RL epochs of "
          f"{train_subset} sources)")
    print(f"  {'SFT checkpoint':>14}: valid {summary['sft']['valid_task_score']['mean']:.4f}  "
          f"test {summary['sft']['test_task_score']['mean']:.4f}"
          + (f"  A {summary['sft']['phrasings']['A']['mean']:.0%}" if "phrasings" in summary["sft"] else ""))
    for arm in arms:
        s = summary[arm]
        line = (f"  {arm:>14}: valid {s['valid_task_score']['mean']:.4f} ± {s['valid_task_score']['std']:.4f}  "
                f"test {s['test_task_score']['mean']:.4f} ± {s['test_task_score']['std']:.4f}  "
                f"KL {s['kl_to_start']['mean']:.3f}  {s['seconds']['mean']:.0f} s")
        if "phrasings" in s:
            line += f"  A {s['phrasings']['A']['mean']:.0%} prefix {s['phrasings']['prefix']['mean']:.0%}"
        for split in ("test", "heldout"):
            if f"paired_diff_{split}" in s:
                d = s[f"paired_diff_{split}"]
                line += (f"  | {split} vs {summary['baseline']} {d['mean']:+.4f} ± {d['std']:.4f} "
                         f"({d['relative']:+.1%}, "
                         f"{d['sigmas'] if d['sigmas'] is None else round(d['sigmas'], 1)} σ)")
        print(line)
    for name, value in oracles.items():
        print(f"  {name:>14}: test {value:.4f}")
    for seed in summary.get("excluded_seeds", []):  # the seeds whose SFT checkpoint collapsed
        print(f"  seed {seed}: the SFT checkpoint writes the same few texts whatever the source "
              f"(distinct_outputs {sft[seed]['valid_distinct_outputs']:.3f}); its arms compare nothing and "
              f"are left out of the figures above")
    for split in ("test", "heldout"):
        if f"headroom_{split}" in summary["sft"]:
            h = summary["sft"][f"headroom_{split}"]
            print(f"  SFT headroom on {split}: greedy {h['greedy']['mean']:.4f}  one sample {h['sample']['mean']:.4f}"
                  f"  consensus of {sft[seeds[0]][f'headroom_{split}']['candidates']} "
                  f"{h['consensus']['mean']:.4f} ({h['consensus_gain']['mean']:+.1%} ± "
                  f"{h['consensus_gain']['std']:.1%})  best by the reference {h['oracle_best']['mean']:.4f}")


def readings(payload: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[str, dict[int, dict[str, Any]]]]:
    """A saved result's per-seed readings, keyed by int seed: (SFT checkpoint's, each arm's)."""
    return ({int(s): v for s, v in payload["sft"].items()},
            {arm: {int(s): r for s, r in runs.items()} for arm, runs in payload["arms"].items()})


def resummarize(path: Path) -> None:
    """Recompute a saved result's summary (and its `beats_sft_on_test` flags) from its per-seed readings."""
    payload = json.loads(path.read_text())
    sft, arms = readings(payload)
    payload["summary"] = summary = summarize(sft, arms)
    settings = payload["settings"]
    print_summary(payload["task"], sorted(sft), settings["rl_epochs"], settings["train_subset"], sft, list(arms),
                  payload["oracles"], summary)
    atomic_write_json(path, payload)
    print("rewrote", path)


def pool(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One reading from several saved ones of the same benchmark on disjoint seeds (a confirmation run beside the
    first): their per-seed readings side by side and the summary recomputed over all of them. Readings of
    another task, other settings (seeds aside) or another CPU model are refused: a pooled figure must be one
    experiment, run again."""
    if len(payloads) < 2:
        raise ValueError("--pool: give two or more results")
    first = payloads[0]
    same = {k: v for k, v in first["settings"].items() if k != "seeds"}
    seen: set[str] = set()
    for i, p in enumerate(payloads):
        for key, want, got in (("task", first["task"], p["task"]), ("machine.cpu", first["machine"]["cpu"],
                                                                     p["machine"]["cpu"])):
            if got != want:
                raise ValueError(f"--pool: result {i + 1}'s {key} is {got!r}, result 1's {want!r}")
        for key in sorted((set(p["settings"]) | set(same)) - {"seeds"}):
            if p["settings"].get(key) != same.get(key):
                raise ValueError(f"--pool: result {i + 1}'s settings.{key} is {p['settings'].get(key)!r}, "
                                 f"result 1's {same.get(key)!r}")
        if overlap := seen & set(p["sft"]):
            raise ValueError(f"--pool: seed {', '.join(sorted(overlap))} is in more than one result")
        seen |= set(p["sft"])
    parts = [readings(p) for p in payloads]
    sft = {s: v for part_sft, _ in parts for s, v in part_sft.items()}
    arms = {arm: {s: r for _, part_arms in parts for s, r in part_arms[arm].items()} for arm in first["arms"]}
    settings = {**first["settings"], "seeds": sorted(sft)}
    return {"benchmark": first["benchmark"], "task": first["task"], "settings": settings,
            "sft": {str(s): sft[s] for s in sorted(sft)}, "oracles": first["oracles"],
            "arms": {arm: {str(s): runs[s] for s in sorted(runs)} for arm, runs in arms.items()},
            "summary": summarize(sft, arms), "pooled_from": [p["machine"] for p in payloads],
            "total_seconds": round(sum(p["total_seconds"] for p in payloads), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASK_SETTINGS), default="synth")
    ap.add_argument("--workdir", type=Path, default=None, help="where runs go (default: a temp dir, removed)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds; each reruns the whole pipeline")
    ap.add_argument("--arms", default=",".join(ALL_ARMS),
                    help=f"comma-separated, from {', '.join(ALL_ARMS)}; `<algorithm>:<variant>` with a variant of "
                         f"{', '.join(VARIANTS)}")
    ap.add_argument("--rl-epochs", type=int, default=3, help="rl.epochs of every arm (one validation point each)")
    ap.add_argument("--train-subset", type=int, default=512, help="rl.train_subset: sources per RL epoch")
    ap.add_argument("--batch-size", type=int, default=32, help="rl.batch_size: sources per learner step")
    ap.add_argument("--override", action="append", default=[], help="key=value for every arm (repeatable)")
    ap.add_argument("--base-override", action="append", default=[],
                    help="key=value for the shared stages (the arms take them too: their model is the base's)")
    ap.add_argument("--nl-size", type=int, default=8000, help="rows of a natural-language task (wordnet, docstrings)")
    ap.add_argument("--no-save", action="store_true", help="print only; leave bench/results/ alone")
    ap.add_argument("--heldout", type=int, default=0,
                    help="docstring task: also score every arm on this many pairs outside the run's splits")
    ap.add_argument("--fresh-sources", type=int, default=0,
                    help="docstring task: the RL arms train on this many pairs outside the run's splits (and the "
                         "held-out rows) instead of the SFT training split; --train-subset still caps them")
    ap.add_argument("--rl-split", type=float, default=0.0, metavar="FRACTION",
                    help="hold this fraction of the training sources back from SFT (their rows stay together); every "
                         "arm, continued SFT included, trains on them instead of the SFT training split")
    ap.add_argument("--results-name", default=None,
                    help="stem of the saved JSON and PNG in bench/results/ (default: algorithms_<task>)")
    ap.add_argument("--resummarize", type=Path, default=None, metavar="JSON",
                    help="run nothing: recompute a saved result's summary from its per-seed readings, print it and "
                         "rewrite the file (after a change to the summary's rules)")
    ap.add_argument("--pool", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: pool saved results of the same settings on disjoint seeds into one "
                         "(--results-name names it), print and save it")
    args = ap.parse_args()
    if args.resummarize:
        resummarize(args.resummarize)
        return
    if args.pool:
        if not args.results_name:
            ap.error("--pool needs --results-name")
        try:
            payload = pool([json.loads(path.read_text()) for path in args.pool])
        except (OSError, ValueError, KeyError) as e:
            ap.error(str(e))
        sft, arms = readings(payload)
        print_summary(payload["task"], sorted(sft), payload["settings"]["rl_epochs"],
                      payload["settings"]["train_subset"], sft, list(arms), payload["oracles"], payload["summary"])
        plot(RESULTS / f"{args.results_name}.png", payload["task"], sft, arms)
        print("saved", save(args.results_name, payload), "and", RESULTS / f"{args.results_name}.png")
        return
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(a for a in arms if a.split(":")[0] not in ALL_ARMS
                     or (":" in a and a.split(":", 1)[1] not in VARIANTS))
    if unknown or not seeds:
        ap.error(f"--arms: unknown {unknown} (known: {', '.join(ALL_ARMS)})" if unknown else "--seeds is empty")
    for flag in ("heldout", "fresh_sources"):
        if getattr(args, flag) and args.task != "docstrings":
            ap.error(f"--{flag.replace('_', '-')}: only the docstring task has pairs outside its splits to draw from")
    if args.rl_split and args.fresh_sources:
        ap.error("--rl-split and --fresh-sources both say where RL's sources come from; give one")
    if not args.rl_split and any(a.endswith(":replay") for a in arms):
        ap.error("--arms: the replay variant adds the rows --rl-split holds back to SFT's; give --rl-split")
    setup_logging()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlt2t-algorithms-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        sft: dict[int, dict[str, Any]] = {}
        results: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in arms}
        oracles: dict[str, float] = {}
        try:
            for seed in seeds:
                base = base_config(args.task, workdir, seed, args)
                if args.task == "wordnet" and not base.path(base.data.train).is_file():
                    make_wordnet_data(base, size=args.nl_size, seed=7)  # the same rows for every seed
                if args.task == "docstrings" and not base.path(base.data.train).is_file():
                    make_docstring_data(base, size=args.nl_size, seed=7)
                if args.task == "docstring_names" and not base.path(base.data.train).is_file():
                    make_docstring_names_data(base, seed=7)
                heldout = heldout_split(base, args.heldout) if args.heldout else None
                sources = fresh_sources(base, args.fresh_sources, heldout) if args.fresh_sources else None
                if args.rl_split:
                    sft_rows, sources = rl_split(base.path(base.data.train), args.rl_split)
                    base = base_config(args.task, workdir, seed, args, f"data.train={sft_rows}")
                t0 = time.perf_counter()
                sft_ckpt = prepare_sft(base)
                probe = arm_config(base, "continued_sft", args)  # the SFT checkpoint's own readings
                sft[seed] = {**_valid_readings(probe, sft_ckpt, seed),
                             "test_task_score": eval_job(probe, checkpoint=sft_ckpt, label="sft")["task_score"],
                             "seconds": round(time.perf_counter() - t0, 1)}
                sft[seed]["headroom_test"] = headroom(probe, sft_ckpt, load_split(probe, "test"), "sft-test")
                if heldout:
                    sft[seed]["heldout_task_score"] = heldout_score(probe, sft_ckpt, heldout, f"sft-{heldout.stem}")
                    held = on_heldout(probe, heldout)
                    sft[seed]["headroom_heldout"] = headroom(held, sft_ckpt, load_split(held, "test"),
                                                             f"sft-{heldout.stem}")
                if args.task == "synth":
                    sft[seed]["phrasings"] = phrasings(probe, "sft")
                    oracles = oracles or oracle_scores(probe)
                for arm in arms:
                    cfg = arm_config(base, arm, args, sources)
                    results[arm][seed] = r = run_arm(cfg, sft_ckpt)
                    if heldout:
                        r["heldout_task_score"] = heldout_score(cfg, Path(r["checkpoint"]), heldout,
                                                              f"last-{heldout.stem}")
                    if args.task == "synth":
                        r["phrasings"] = phrasings(cfg, "last")
                    log.info("%s %s seed %d: valid %.4f test %.4f KL %.3f, %.0f s", args.task, arm, seed,
                             r["valid"][-1]["task_score"], r["test"]["task_score"], r["kl_to_start"], r["seconds"])
        finally:
            import ray

            ray.shutdown()
    summary = summarize(sft, results)
    print_summary(args.task, seeds, args.rl_epochs, args.train_subset, sft, arms, oracles, summary)
    if args.no_save:
        return
    payload = {"benchmark": "algorithms", "task": args.task,
               "settings": {"seeds": seeds, "arms": arms, "rl_epochs": args.rl_epochs,
                            "train_subset": args.train_subset, "batch_size": args.batch_size, "heldout": args.heldout,
                            "fresh_sources": args.fresh_sources, "rl_split": args.rl_split,
                            "task_settings": TASK_SETTINGS[args.task], "overrides": args.override,
                            "base_overrides": args.base_override},
               "sft": {str(s): v for s, v in sft.items()}, "oracles": oracles,
               "arms": {arm: {str(s): r for s, r in runs.items()} for arm, runs in results.items()},
               "summary": summary, "total_seconds": round(time.perf_counter() - t_start, 1)}
    name = args.results_name or f"algorithms_{args.task}"
    plot(RESULTS / f"{name}.png", args.task, sft, results)
    print("saved", save(name, payload), "and", RESULTS / f"{name}.png")


def _valid_readings(cfg: Config, checkpoint: Path, seed: int) -> dict[str, Any]:
    """The SFT checkpoint's validation task score, decoded as the RL job's per-epoch validation does, and the
    variety of its outputs; a checkpoint that writes the same few texts whatever the source is flagged
    ``collapsed`` (its arms compare nothing: RL from it is not RL from a trained model)."""
    from rlt2t.learner.evaluate import collapse_warning, distinct_outputs, generate, metric_table

    valid = load_split(cfg, "valid")[: cfg.metric.monitor_size]
    policy = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=checkpoint)
    hyps = generate(policy, [e.source for e in valid], max_new_tokens=cfg.eval.max_new_tokens,
                    max_source_len=cfg.data.max_source_len)
    distinct = distinct_outputs([e.source for e in valid], hyps)
    out = {"valid_task_score": metric_table(hyps, [list(e.refs) for e in valid], cfg.metric)["task_score"],
           "valid_distinct_outputs": distinct}
    message = collapse_warning(f"seed {seed}'s SFT checkpoint {checkpoint}", distinct, valid,
                               "its arms compare nothing; fix the SFT stage before reading them")
    if message:
        log.warning(message)
        out["collapsed"] = True
    return out


if __name__ == "__main__":
    main()
