"""Means over every learner rank: under DDP (which averages the ranks' gradients) a policy-gradient step, and a
rank-RL step, give the gradient one learner gives on the whole batch, whatever the ranks' token counts."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.learner.losses import clipped_policy_loss, pairwise_rank_loss
from rlt2t.learner.objectives import pooled_rank_loss, rank_token_share
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
    Path(results, f"{rank}.json").write_text(json.dumps(grads))
    # No teardown: with torch 2.13's gloo, freeing a DDP model can deadlock. The Reducer's dealloc holds the GIL
    # while ~ProcessGroupGloo joins a worker thread that is itself freeing a finished all-reduce and waits for
    # the GIL (py-spy --native on a hung rank; 9 of 20 runs of the old teardown hung here, 0 of 20 with this exit;
    # CI hung on it twice). The learner never frees its DDP module (shutdown destroys the group, then Ray kills
    # the actor); a test rank just exits.
    os._exit(0)


def _run_two_ranks(tmp_path: Path, deadline_s: float = 90.0) -> dict[int, dict]:
    """Both ranks' gradients. A rank still running at the deadline has its Python stacks dumped into the test's
    captured stderr (faulthandler on SIGABRT) and both are killed, so a hang fails here, it does not outlive the
    session (pytest waits on live non-daemon children at exit)."""
    os.environ["PYTHONFAULTHANDLER"] = "1"
    try:
        context = mp.start_processes(_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2,
                                     join=False, start_method="spawn")
    finally:
        del os.environ["PYTHONFAULTHANDLER"]
    try:
        stop = time.monotonic() + deadline_s
        while not context.join(timeout=1.0):
            if time.monotonic() > stop:
                for process in context.processes:  # one at a time, so that the two dumps do not interleave
                    if process.is_alive():
                        os.kill(process.pid, signal.SIGABRT)
                        process.join(5)
                pytest.fail(f"the two gloo ranks did not finish in {deadline_s:.0f} s; their stacks are in the "
                            "captured stderr")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}


def test_one_rank_is_unscaled():
    assert rank_token_share(_Ranks(), MASK) == 1.0
    assert rank_token_share(_Ranks(), torch.zeros(2, 3, dtype=torch.bool)) == 1.0


@pytest.mark.timeout(120)
def test_two_ddp_ranks_step_as_one_learner_on_the_whole_batch(tmp_path):
    single = _model()
    _loss(single(torch.ones(1, 1)).expand(4, 10), [0, 1, 2, 3]).backward()
    expected = single.weight.grad.flatten().tolist()
    grads = _run_two_ranks(tmp_path)
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


def test_rank_rl_with_one_rank_is_its_loss_exactly():
    logits = _rank_model()(torch.ones(1, 1)).view(1, 9, 10).expand(2, 9, 10)
    logp = logits.log_softmax(-1)
    ce = F.cross_entropy(logits.flatten(0, 1), GOLD.flatten(), ignore_index=IGNORE_INDEX)
    score = {k: logp.gather(-1, v.clamp(min=0).unsqueeze(-1)).squeeze(-1)
             for k, v in (("a", LABELS_A), ("b", LABELS_B))}
    rank = pairwise_rank_loss(score["a"], score["b"], LABELS_A, LABELS_B, torch.ones(2, dtype=torch.bool), 0.9)[0]
    assert torch.equal(_rank_loss(logits, [0, 1]), ce + 0.5 * rank)
