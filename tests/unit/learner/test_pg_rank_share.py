"""Token means over every learner rank: under DDP (which averages the ranks' gradients) a policy-gradient step
gives the gradient one learner gives on the whole batch, whatever the ranks' token counts."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlt2t.learner.losses import clipped_policy_loss
from rlt2t.learner.objectives import rank_token_share

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


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(1, 10, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_model())
        logp = model(torch.ones(1, 1)).expand(4, 10)
        _loss(logp, list(SHARDS[rank])).backward()
        out[rank] = model.module.weight.grad.flatten().tolist()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_rank_is_unscaled():
    assert rank_token_share(_Ranks(), MASK) == 1.0
    assert rank_token_share(_Ranks(), torch.zeros(2, 3, dtype=torch.bool)) == 1.0


@pytest.mark.timeout(120)
def test_two_ddp_ranks_step_as_one_learner_on_the_whole_batch():
    single = _model()
    _loss(single(torch.ones(1, 1)).expand(4, 10), [0, 1, 2, 3]).backward()
    expected = single.weight.grad.flatten().tolist()
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), out), nprocs=2)
        grads = dict(out)
    # Unscaled, the mean of the ranks' token means weighted the 4 short tokens like the 20 long ones: -0.225
    # where the whole batch's token mean gives -0.125.
    assert grads[0] == grads[1]
    assert grads[0] == pytest.approx(expected, abs=1e-7)
