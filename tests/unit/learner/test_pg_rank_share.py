"""Means over every learner rank: under DDP (which averages the ranks' gradients) a policy-gradient step, and a
rank-RL step, give the gradient one learner gives on the whole batch, whatever the ranks' token counts; so does a
policy-gradient objective's whole step with its likelihood term (rl.pg.sft_coef), whose gold tokens are counted
apart from the samples'."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.common.config import RLConfig, RolloutConfig
from rlt2t.learner.batch import GroupBatch
from rlt2t.learner.group_step import GroupOutput
from rlt2t.learner.losses import clipped_policy_loss, pairwise_rank_loss
from rlt2t.learner.objectives import PolicyGradientObjective, pooled_rank_loss, rank_token_share
from rlt2t.learner.rank_step import RankBatch

# Source 0 sampled long (10 tokens per row), source 1 short (2): shards items[i::2] give rank 0 the long one.
ADVANTAGES = torch.tensor([1.0, 0.5, 1.0, 0.5])
MASK = torch.zeros(4, 10, dtype=torch.bool)
MASK[:2] = True
MASK[2:, :2] = True
SHARDS = ([0, 1], [2, 3])


class _Ranks:
    """The StepRunner's all_sum over a gloo process group (itself with one process)."""

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(values)
        return values


def _loss(logp: torch.Tensor, rows: list[int]) -> torch.Tensor:
    mask = MASK[rows]
    loss = clipped_policy_loss(logp[rows], logp[rows].detach(), ADVANTAGES[rows], mask, 0.2)[0]
    return loss * rank_token_share(_Ranks(), mask)


# Rank RL: pair 0 long (gold 9 tokens, a and b differ from step 1 of 9), pair 1 short (gold 2, differ at 0 of 2).
GOLD = torch.full((2, 9), IGNORE_INDEX)
GOLD[0], GOLD[1, :2] = torch.arange(9), torch.tensor([3, 4])
LABELS_A = torch.full((2, 9), IGNORE_INDEX)
LABELS_A[0], LABELS_A[1, :2] = torch.arange(9), torch.tensor([5, 6])
LABELS_B = LABELS_A.clone()
LABELS_B[0, 1:], LABELS_B[1, :2] = 0, torch.tensor([7, 8])


def _rank_loss(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """CE over the gold labels and the pairwise rank loss of a over b, from [2, 9, 10] logits, pooled."""
    gold, a, b = GOLD[rows], LABELS_A[rows], LABELS_B[rows]
    logp = logits[rows].log_softmax(-1)
    ce = F.cross_entropy(logits[rows].flatten(0, 1), gold.flatten(), ignore_index=IGNORE_INDEX)

    def scores(labels: torch.Tensor) -> torch.Tensor:
        return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)

    use = torch.ones(len(rows), dtype=torch.bool)
    rank = pairwise_rank_loss(scores(a), scores(b), a, b, use, 0.9, IGNORE_INDEX)[0]
    ones = torch.ones(len(rows), 1, dtype=torch.long)
    batch = RankBatch(input_ids=0 * ones, attention_mask=ones, gold_labels=gold, labels_a=a, labels_b=b,
                      use_rank=use)
    return pooled_rank_loss(_Ranks(), ce, rank, batch, 0.5, 0.9)


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(1, 10, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def _rank_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(1, 90, bias=False)


# A GRPO step with the likelihood term on 2 sources x 2 samples. Source 0: long samples (8 tokens), a short gold
# (2); source 1: short samples (2), a long gold (8). Each rank holds one source, so the two terms' token shares
# differ: scaling the gold cross-entropy by the samples' share would weigh source 1's 8 gold tokens as 2.
PG_VOCAB, PG_T = 7, 8
PG_SAMPLES = torch.full((4, PG_T), IGNORE_INDEX)  # rep-major: row j * 2 + i = sample j of source i
PG_SAMPLES[0], PG_SAMPLES[2] = torch.arange(PG_T) % 5 + 1, (torch.arange(PG_T) + 2) % 5 + 1
PG_SAMPLES[1, :2], PG_SAMPLES[3, :2] = torch.tensor([3, 4]), torch.tensor([5, 6])
PG_GOLD = torch.full((2, PG_T), IGNORE_INDEX)
PG_GOLD[0, :2], PG_GOLD[1] = torch.tensor([2, 3]), (torch.arange(PG_T) + 1) % 6 + 1


def _pg_batch() -> GroupBatch:
    return GroupBatch(input_ids=torch.tensor([[0], [1]]), attention_mask=torch.ones(2, 1, dtype=torch.long),
                      labels=PG_SAMPLES, sample_logprobs=torch.zeros(4, PG_T), loss_mask=PG_SAMPLES != IGNORE_INDEX,
                      rewards=torch.tensor([[1.0, 0.0], [0.0, 2.0]]), gold_labels=PG_GOLD)


def _pg_step(batch: GroupBatch, all_sum, all_reduce_grad, **pg) -> list[float]:
    """One GRPO step (rl.pg.sft_coef = 0.5 unless ``pg`` says otherwise) on a 'policy' whose logits are one
    parameter per (source, row of the source, position): the objective's own arithmetic, no model. Returns the
    (rank-averaged) gradient."""
    weights = torch.nn.Parameter(torch.randn(2, 3, PG_T, PG_VOCAB, generator=torch.Generator().manual_seed(0)))
    rl = RLConfig(algorithm="grpo", kl={"coef": 0.0}, pg={"sft_coef": 0.5, "epochs": 1, "minibatches": 1, **pg})
    policy = types.SimpleNamespace(model=torch.nn.Linear(1, 1))  # unused: forward below is the policy
    objective = PolicyGradientObjective(rl, RolloutConfig(num_samples=2), policy, seed=0)
    grads: list[float] = []

    def forward(input_ids, attention_mask, labels, k):
        size = input_ids.shape[0]
        sources = input_ids[:, 0].repeat(k)  # row j * size + i: source i, its row j
        rows = torch.arange(k).repeat_interleave(size)
        return GroupOutput(weights[sources, rows, : labels.shape[1]], None)

    def optimize(loss):
        loss.backward()
        grads.extend(all_reduce_grad(weights.grad).flatten().tolist())
        return 0.0

    runner = types.SimpleNamespace(device=torch.device("cpu"), forward=forward, optimize=optimize, all_sum=all_sum,
                                   all_min=lambda v: v, autocast=contextlib.nullcontext)
    objective.step(runner, batch, [], 0)
    return grads


def _all_reduce_mean(grad: torch.Tensor) -> torch.Tensor:
    """What DDP does with each rank's gradient."""
    dist.all_reduce(grad)
    return grad / dist.get_world_size()


def _rank(rank: int, rendezvous: str, results: str) -> None:
    # A file, not a port chosen in advance: a port free when chosen can be taken by another process (a Ray of
    # the test session) before rank 0 binds it, and rank 1 would then wait on a stranger forever.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = torch.nn.parallel.DistributedDataParallel(_model())
    logp = model(torch.ones(1, 1)).expand(4, 10)
    _loss(logp, list(SHARDS[rank])).backward()
    grads = {"pg": model.module.weight.grad.flatten().tolist()}
    ranked = torch.nn.parallel.DistributedDataParallel(_rank_model())
    _rank_loss(ranked(torch.ones(1, 1)).view(1, 9, 10).expand(2, 9, 10), [rank]).backward()
    grads["rank"] = ranked.module.weight.grad.flatten().tolist()
    grads["pg_sft"] = _pg_step(_pg_batch().select(torch.tensor([rank])), _Ranks().all_sum, _all_reduce_mean)
    grads["pg_batch_scale"] = _pg_step(_pg_batch().select(torch.tensor([rank])), _Ranks().all_sum, _all_reduce_mean,
                                       sft_coef=0.0, grpo_scale="batch")
    Path(results, f"{rank}.json").write_text(json.dumps(grads))
    # No teardown: with torch 2.13's gloo, freeing a DDP model can deadlock. The Reducer's dealloc holds the GIL
    # while ~ProcessGroupGloo joins a worker thread that is itself freeing a finished all-reduce and waits for
    # the GIL (py-spy --native on a hung rank; 9 of 20 runs of the old teardown hung here, 0 of 20 with this exit;
    # CI hung on it twice). The learner never frees its DDP module (shutdown destroys the group, then Ray kills
    # the actor); a test rank just exits.
    os._exit(0)


def test_one_rank_is_unscaled():
    assert rank_token_share(_Ranks(), MASK) == 1.0
    assert rank_token_share(_Ranks(), torch.zeros(2, 3, dtype=torch.bool)) == 1.0


@pytest.mark.timeout(120)
def test_two_ddp_ranks_step_as_one_learner_on_the_whole_batch(tmp_path, run_ranks):
    single = _model()
    _loss(single(torch.ones(1, 1)).expand(4, 10), [0, 1, 2, 3]).backward()
    expected = single.weight.grad.flatten().tolist()
    run_ranks(_rank, (str(tmp_path / "rendezvous"), str(tmp_path)))
    grads = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}
    # Unscaled, the mean of the ranks' token means weighted the 4 short tokens like the 20 long ones: -0.225
    # where the whole batch's token mean gives -0.125.
    assert grads[0]["pg"] == grads[1]["pg"]
    assert grads[0]["pg"] == pytest.approx(expected, abs=1e-7)
    # Rank RL: CE over the gold tokens and the rank loss over the counted steps' weights, pooled over the ranks
    # (before, each rank's own means: the short pair's 2 gold tokens weighed as much as the long pair's 9).
    single = _rank_model()
    _rank_loss(single(torch.ones(1, 1)).view(1, 9, 10).expand(2, 9, 10), [0, 1]).backward()
    expected = single.weight.grad.flatten().tolist()
    assert grads[0]["rank"] == grads[1]["rank"]
    assert grads[0]["rank"] == pytest.approx(expected, abs=1e-6)
    # A policy-gradient step with the likelihood term: each term pooled over its own tokens.
    expected = _pg_step(_pg_batch(), lambda v: v, lambda g: g)
    assert grads[0]["pg_sft"] == grads[1]["pg_sft"]
    assert grads[0]["pg_sft"] == pytest.approx(expected, abs=1e-6)
    # GRPO's batch scale (rl.pg.grpo_scale=batch): the std of the rewards' deviations over both ranks' sources,
    # which the two sources' reward spreads (1 and 2) set apart from the per-source scale.
    expected = _pg_step(_pg_batch(), lambda v: v, lambda g: g, sft_coef=0.0, grpo_scale="batch")
    assert grads[0]["pg_batch_scale"] == grads[1]["pg_batch_scale"]
    assert grads[0]["pg_batch_scale"] == pytest.approx(expected, abs=1e-6)
    per_source = _pg_step(_pg_batch(), lambda v: v, lambda g: g, sft_coef=0.0, grpo_scale="group")
    assert max(abs(a - b) for a, b in zip(expected, per_source, strict=True)) > 1e-3


def test_rank_rl_with_one_rank_is_its_loss_exactly():
    logits = _rank_model()(torch.ones(1, 1)).view(1, 9, 10).expand(2, 9, 10)
    logp = logits.log_softmax(-1)
    ce = F.cross_entropy(logits.flatten(0, 1), GOLD.flatten(), ignore_index=IGNORE_INDEX)
    score = {k: logp.gather(-1, v.clamp(min=0).unsqueeze(-1)).squeeze(-1)
             for k, v in (("a", LABELS_A), ("b", LABELS_B))}
    rank = pairwise_rank_loss(score["a"], score["b"], LABELS_A, LABELS_B, torch.ones(2, dtype=torch.bool), 0.9)[0]
    assert torch.equal(_rank_loss(logits, [0, 1]), ce + 0.5 * rank)
