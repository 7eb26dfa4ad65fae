"""Learner without Ray (world size 1): steps, state round trip, evaluation."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.config import MetricConfig, ModelConfig, RLConfig
from rlt2t.common.data import Example
from rlt2t.common.types import ScoredPair
from rlt2t.learner.evaluate import distinct_outputs, generate
from rlt2t.learner.learner import BatchTooLarge, Learner


def _pairs(n: int) -> list[ScoredPair]:
    return [ScoredPair(example_id=str(i), source=f"{i} {i + 1} {i + 2}", reference=f"{i}", a=f"{i}", b=f"{i + 1} 7",
                       score_a=1.0, score_b=0.2, use_rank=True, policy_version=0) for i in range(n)]


def _learner(tmp_path, tiny_policy) -> Learner:
    tiny_policy.model.save_pretrained(tmp_path / "init")
    tiny_policy.tokenizer.save_pretrained(tmp_path / "init")
    return Learner(ModelConfig(dropout=0.1), None, RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0, batch_size=32),
                   init_checkpoint=str(tmp_path / "init"), rank=0, world_size=1, total_steps=20, seed=0,
                   max_source_len=32, max_target_len=16)


def test_steps_change_weights_and_log_scalars(tmp_path, tiny_policy):
    learner = _learner(tmp_path, tiny_policy)
    before = learner.weights()
    metrics = learner.train_step(_pairs(8))
    assert {"loss", "ce", "rank_loss", "pair_accuracy", "reward_a", "reward_b", "lr"} <= set(metrics)
    assert metrics["reward_a"] == 1.0 and abs(metrics["reward_b"] - 0.2) < 1e-12
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    after = learner.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_training_state_round_trip_continues_identically(tmp_path, tiny_policy):
    a = _learner(tmp_path / "a", tiny_policy)
    a.train_step(_pairs(8))
    state, weights = a.training_state(), a.weights()
    a.train_step(_pairs(8))
    b = _learner(tmp_path / "b", tiny_policy)
    b.policy.model.load_state_dict(weights)
    b.load_training_state(state)
    b.train_step(_pairs(8))
    wa, wb = a.weights(), b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # dropout RNG, Adam moments and schedule restored


def test_evaluate_returns_the_metric_table_and_the_outputs_in_order(tmp_path, tiny_policy):
    learner = _learner(tmp_path, tiny_policy)
    examples = [Example(id=str(i), source=f"{i} 3", target=f"{i}") for i in range(5)]
    table, outputs = learner.evaluate(examples, MetricConfig(), max_new_tokens=4)
    assert {"cider_d", "bleu4", "task_score"} <= set(table)
    assert "monitor" not in table  # the job scores metric.monitor on the outputs, where its plugins are
    said = generate(tiny_policy, [e.source for e in examples], max_new_tokens=4)
    assert outputs == said
    assert table["distinct_outputs"] == distinct_outputs([e.source for e in examples], said)
    # Unlabeled rows (RL on sources alone, monitored by a reward): the outputs, and no table to score them by.
    unlabeled = [Example(id=e.id, source=e.source, target=None) for e in examples]
    table, outputs = learner.evaluate(unlabeled, MetricConfig(), max_new_tokens=4)
    assert outputs == said and table == {"distinct_outputs": distinct_outputs([e.source for e in examples], said)}
    table, _ = learner.evaluate(examples, MetricConfig(), 4, ["chrf"])  # the columns the job asks for
    assert list(table) == ["chrf", "distinct_outputs"]


def test_accelerate_autocast_path_runs_in_bf16(tmp_path, tiny_policy):
    """The mixed-precision path through accelerate (autocast, backward, clipping, step), exercised on CPU's
    bf16 autocast: runs only ever use it on CUDA, but the code path is the same and no GPU is needed here."""
    from accelerate.state import AcceleratorState

    learner = _learner(tmp_path, tiny_policy)
    assert learner.mixed_precision == "no"  # CPU runs stay float32 (and bitwise reproducible)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        learner.mixed_precision = "bf16"
        acc = learner._prepare()
        assert acc.mixed_precision == "bf16"
        captured = []
        hook = learner.policy.model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.dtype))
        before = learner.weights()
        metrics = learner.train_step(_pairs(8))
        hook.remove()
        assert captured and captured[0] == torch.bfloat16  # the forward really ran under autocast
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        after = learner.weights()
        assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay float32
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_preflight_runs_the_largest_batch_and_leaves_training_unchanged(tmp_path, tiny_policy):
    """Preflight then steps gives bitwise the losses and weights of the same steps alone."""
    # One learner at a time: the constructor seeds the process's global RNG, which dropout draws from.
    plain = _learner(tmp_path / "plain", tiny_policy)
    plain_losses = [plain.train_step(_pairs(8))["loss"] for _ in range(2)]
    plain_weights = plain.weights()

    checked = _learner(tmp_path / "checked", tiny_policy)
    shapes = []
    hook = checked.policy.model.get_encoder().register_forward_hook(lambda m, i, o: shapes.append(tuple(o[0].shape)))
    rng_before = torch.get_rng_state()
    stats = checked.preflight()
    hook.remove()
    # The largest shard: rank.batch_size pairs (one rank) of max_source_len source tokens.
    assert shapes == [(32, 32, checked.policy.model.config.d_model)]
    assert (stats["sources"], stats["source_tokens"], stats["target_tokens"]) == (32, 32, 16)
    assert stats["seconds"] > 0 and stats["peak_memory_gib"] > 0
    assert torch.equal(torch.get_rng_state(), rng_before)  # dropout's draws were given back
    assert all(p.grad is None for p in checked.policy.model.parameters())
    assert not checked.optimizer.state  # no optimizer step was taken
    assert [checked.train_step(_pairs(8))["loss"] for _ in range(2)] == plain_losses
    checked_weights = checked.weights()
    assert all(torch.equal(plain_weights[k], checked_weights[k]) for k in plain_weights)


def test_preflight_shard_shape_follows_the_world_size(tmp_path, tiny_policy):
    learner = _learner(tmp_path, tiny_policy)
    learner.world_size = 3  # the shape only; no process group is formed
    assert learner.largest_batch_shape() == (11, 32, 16)  # ceil(32 / 3) pairs per rank


def test_preflight_out_of_memory_names_the_settings(tmp_path, tiny_policy, monkeypatch):
    learner = _learner(tmp_path, tiny_policy)
    learner._prepare()

    def no_memory(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(learner, "module", no_memory)
    with pytest.raises(BatchTooLarge) as err:
        learner.preflight()
    message = str(err.value)
    for setting in ("rl.batch_size=32", "rl.learners=1", "data.max_source_len=32", "data.max_target_len=16",
                    "Tried to allocate 20.00 GiB"):
        assert setting in message


def test_preflight_lets_other_errors_through(tmp_path, tiny_policy, monkeypatch):
    learner = _learner(tmp_path, tiny_policy)
    learner._prepare()

    def broken(batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(learner, "module", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as err:
        learner.preflight()
    assert "does not fit in memory" not in str(err.value)
