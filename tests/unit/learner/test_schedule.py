"""Tests for rlt2t.learner.schedule: linear warmup, linear decay, floor, checkpointable state."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlt2t.learner.schedule import LinearWarmupDecay, linear_warmup_decay

BASE_LR = 2e-5


def make(warmup_steps: int = 10, total_steps: int = 110, min_lr_ratio: float = 0.1):
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=BASE_LR)
    sched = linear_warmup_decay(
        optimizer, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return optimizer, sched


def lrs(optimizer, sched, steps: int) -> list[float]:
    """lr used at each of the next `steps` optimizer steps."""
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    return out


def test_values_at_key_steps() -> None:
    optimizer, sched = make(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    seq = lrs(optimizer, sched, 131)
    # warmup: step/10 of base; decay over 100 steps from 1 to 0.1, i.e. 1 - 0.9·(s-10)/100; then the floor
    expected = {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 100: 0.19, 110: 0.1, 111: 0.1, 130: 0.1}
    for step, factor in expected.items():
        assert seq[step] == pytest.approx(factor * BASE_LR, rel=1e-9, abs=1e-15), step
    # monotone up through warmup, monotone down afterwards
    assert all(a < b for a, b in zip(seq[:10], seq[1:11], strict=True))
    assert all(a > b for a, b in zip(seq[10:110], seq[11:111], strict=True))


def test_no_warmup_and_zero_floor() -> None:
    f = LinearWarmupDecay(warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    assert [f(s) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_warmup_equal_to_total_drops_to_floor() -> None:
    f = LinearWarmupDecay(warmup_steps=4, total_steps=4, min_lr_ratio=0.2)
    assert [f(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 0.2, 0.2]


def test_every_param_group_follows_its_own_base_lr() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    sched = linear_warmup_decay(optimizer, warmup_steps=2, total_steps=4, min_lr_ratio=0.5)
    optimizer.step()
    sched.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.05])


def test_state_dict_round_trip_continues_identically() -> None:
    optimizer, sched = make()
    lrs(optimizer, sched, 37)
    opt_state, sched_state = optimizer.state_dict(), sched.state_dict()
    # the schedule's fields are in the state dict (a closure would have been dropped)
    assert sched_state["lr_lambdas"][0] == {"warmup_steps": 10, "total_steps": 110, "min_lr_ratio": 0.1}
    expected = lrs(optimizer, sched, 90)

    # resume into a scheduler built with different settings: the checkpoint wins
    resumed_opt, resumed = make(warmup_steps=3, total_steps=20, min_lr_ratio=0.5)
    resumed_opt.load_state_dict(opt_state)
    resumed.load_state_dict(sched_state)
    assert lrs(resumed_opt, resumed, 90) == expected


def test_scheduler_pickles() -> None:
    optimizer, sched = make()
    lrs(optimizer, sched, 15)
    clone = pickle.loads(pickle.dumps(sched))
    assert clone.lr_lambdas[0](60) == pytest.approx(0.55)
    assert clone.last_epoch == sched.last_epoch == 15


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup_steps": -1, "total_steps": 10, "min_lr_ratio": 0.0}, "warmup_steps"),
        ({"warmup_steps": 0, "total_steps": 0, "min_lr_ratio": 0.0}, "total_steps"),
        ({"warmup_steps": 11, "total_steps": 10, "min_lr_ratio": 0.0}, "warmup_steps"),
        ({"warmup_steps": 0, "total_steps": 10, "min_lr_ratio": -0.1}, "min_lr_ratio"),
        ({"warmup_steps": 0, "total_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_bad_arguments_are_named(kwargs, name) -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=name):
        linear_warmup_decay(optimizer, **kwargs)
