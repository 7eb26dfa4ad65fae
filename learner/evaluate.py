"""Decoding a split and scoring it: the metric table of `rlt2t eval` and the per-epoch monitor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from rlt2t.common.batching import collate_seq2seq, encode_texts
from rlt2t.common.config import EvalConfig, MetricConfig
from rlt2t.common.data import Example
from rlt2t.common.metrics import get_metric
from rlt2t.common.policy import Policy

TABLE_METRICS = ("cider_d", "bleu4", "task_score", "rouge_l", "mean_length")


@torch.no_grad()
def generate(policy: Policy, sources: Sequence[str], *, num_beams: int = 1, max_new_tokens: int = 64,
             batch_size: int = 64, max_source_len: int = 128, progress: bool = False) -> list[str]:
    """Greedy (num_beams=1) or beam decoding of ``sources``; returns texts in input order.

    Sources are batched by length (less padding), results put back in order.
    """
    model = policy.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids, _ = encode_texts(policy.tokenizer, sources, max_source_len)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    pad_id = policy.tokenizer.pad_token_id
    for start in tqdm(range(0, len(order), batch_size), desc="decode", disable=not progress, leave=False):
        chunk = order[start : start + batch_size]
        batch = collate_seq2seq([ids[i] for i in chunk], None, pad_id)
        gen = model.generate(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
            num_beams=num_beams, max_new_tokens=max_new_tokens, do_sample=False,
            early_stopping=num_beams > 1,
        )
        for i, text in zip(chunk, policy.decode(gen), strict=True):
            out[i] = text
    model.train(was_training)
    return out


def metric_table(hyps: Sequence[str], refs: Sequence[Sequence[str]], metric: MetricConfig) -> dict[str, float]:
    """CIDEr-D, BLEU-4, task score, ROUGE-L and mean length (corpus values)."""
    return {
        "cider_d": get_metric("cider_d", sigma=metric.cider_sigma).corpus(hyps, refs),
        "bleu4": get_metric("bleu4").corpus(hyps, refs),
        "task_score": get_metric("task_score", bleu_weight=metric.bleu_weight, sigma=metric.cider_sigma).corpus(
            hyps, refs),
        "rouge_l": get_metric("rouge_l").corpus(hyps, refs),
        "mean_length": get_metric("mean_length").corpus(hyps, refs),
    }


@dataclass
class EvalResult:
    metrics: dict[str, float]
    predictions: list[str]


def evaluate(policy: Policy, examples: Sequence[Example], cfg: EvalConfig, metric: MetricConfig,
             max_source_len: int, progress: bool = False) -> EvalResult:
    """Decode ``examples`` with the policy and score against their targets."""
    if cfg.limit:
        examples = examples[: cfg.limit]
    if any(e.target is None for e in examples):
        raise ValueError("evaluation needs targets; this split has unlabeled examples (use `rlt2t predict`)")
    hyps = generate(policy, [e.source for e in examples], num_beams=cfg.num_beams, max_new_tokens=cfg.max_new_tokens,
                    batch_size=cfg.batch_size, max_source_len=max_source_len, progress=progress)
    return EvalResult(metric_table(hyps, [[e.target] for e in examples], metric), hyps)


def monitor_score(policy: Policy, examples: Sequence[Example], metric: MetricConfig, *, max_source_len: int,
                  max_new_tokens: int, batch_size: int = 64) -> dict[str, float]:
    """The validation monitor: greedy decoding scored with (1-w)·CIDEr-D + w·BLEU-4, w = monitor weight."""
    hyps = generate(policy, [e.source for e in examples], max_new_tokens=max_new_tokens, batch_size=batch_size,
                    max_source_len=max_source_len)
    refs = [[e.target] for e in examples]
    score = get_metric("task_score", bleu_weight=metric.monitor_bleu_weight, sigma=metric.cider_sigma)
    return {"monitor": score.corpus(hyps, refs),
            "cider_d": get_metric("cider_d", sigma=metric.cider_sigma).corpus(hyps, refs)}
