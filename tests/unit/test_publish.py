"""The driver out of the data path, without Ray: rank 0 publishes and checkpoints its own weights, the driver
holds references only, scored items reach the learner ranks by reference (issue #39, item 3)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rlt2t.by_reference as by_reference
import rlt2t.driver as driver
import rlt2t.groups as groups
from rlt2t.common.checkpoint import complete_checkpoint, load_training_state
from rlt2t.common.config import LoraConfig, ModelConfig, RLConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.types import ScoredPair
from rlt2t.learner.learner import Learner
from rlt2t.scheduler import StoredItem


def _pairs(n: int) -> list[ScoredPair]:
    return [ScoredPair(example_id=str(i), source=f"{i} {i + 1} {i + 2}", reference=f"{i}", a=f"{i}", b=f"{i + 1} 7",
                       score_a=1.0, score_b=0.2, use_rank=True, policy_version=0) for i in range(n)]


def _learner(tmp_path: Path, tiny_policy) -> Learner:
    tiny_policy.model.save_pretrained(tmp_path / "init")
    tiny_policy.tokenizer.save_pretrained(tmp_path / "init")
    return Learner(ModelConfig(dropout=0.1), None, RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0),
                   init_checkpoint=str(tmp_path / "init"), rank=0, world_size=1, total_steps=20, seed=0,
                   max_source_len=32, max_target_len=16)


class _Remote:
    """A fake actor method: records each call, returns what ``reply`` makes of it."""

    def __init__(self, calls: list, name: str, reply) -> None:
        self.calls, self.name, self.reply = calls, name, reply

    def options(self, **kw):
        return self

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, args, kwargs))
        return self.reply(*args)


def test_rank_0_publishes_views_of_its_weights_with_a_summary_of_its_step(tmp_path, tiny_policy):
    learner = _learner(tmp_path, tiny_policy)
    learner.train_step(_pairs(4))
    summary, weights = learner.publish_weights()
    expected = learner.weights()
    assert summary["step"] == 1 and summary["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    # No copy on CPU: Ray's serialisation of the call's result is the only one.
    live = dict(learner.policy.model.state_dict())
    assert all(weights[k].data_ptr() == live[k].data_ptr() for k in weights)


def test_the_group_publishes_without_fetching_the_weights(monkeypatch):
    calls: list = []
    fetched: list = []
    rank0 = SimpleNamespace(publish_weights=_Remote(calls, "publish_weights", lambda: ("summary-ref", "weights-ref")),
                            weights=_Remote(calls, "weights", lambda: pytest.fail("the weights were fetched")))
    group = object.__new__(groups.LearnerGroup)
    group.ranks, group._joining, group._preflight, group._loading = [rank0], [], [], []
    monkeypatch.setattr(groups.ray, "get", lambda ref, **kw: fetched.append(ref) or {"step": 3, "bytes": 8})
    assert group.publish() == ("weights-ref", 3)
    assert fetched == ["summary-ref"]  # the summary only


def test_the_publisher_hands_on_references_and_refuses_a_version_rank_0_is_not_at():
    published: list = []
    learners = SimpleNamespace(publish=lambda: (f"ref-{len(published)}", 4 + len(published)),
                               weights=lambda: pytest.fail("the driver fetched the weights"),
                               write_published=lambda *a, **k: published.append(a))
    publisher = driver._Publisher(learners, None, "start-ref", start_version=0)  # type: ignore[arg-type]
    publisher.publish(0)
    publisher.publish(4)
    assert publisher.refs == {0: "start-ref", 4: "ref-0"}
    assert publisher.kept(below=4) == {0: "start-ref"}  # references, for rank 0's checkpoint
    with pytest.raises(RuntimeError, match="publishing version 6, learner rank 0 is at step 4"):
        publisher.publish(6)


def test_rank_0_writes_a_checkpoint_that_loads_bitwise_and_resumes_each_rank(tmp_path, tiny_policy):
    learner = _learner(tmp_path / "a", tiny_policy)
    learner.train_step(_pairs(8))
    kept = {0: learner.weights()}
    path = Path(learner.write_checkpoint(str(tmp_path / "ckpt"), "step-000001", 1, {"stage": "rl", "epoch": 0},
                                         ["0", "1"], [0], kept[0]))
    learner.train_step(_pairs(8))  # the uninterrupted run (the process's RNG is the ranks' own: first)
    wa = learner.weights()
    info = complete_checkpoint(path)
    assert info.step == 1 and info.meta["stage"] == "rl"
    loaded = load_policy(ModelConfig(dropout=0.1), None, checkpoint=path).model.state_dict()
    assert all(torch.equal(loaded[k], kept[0][k]) for k in kept[0])  # kept[0]: the weights at the checkpoint
    state = load_training_state(path)
    assert state["trained_in_epoch"] == ["0", "1"] and list(state["published"]) == [0]
    assert all(torch.equal(state["published"][0][k], kept[0][k]) for k in kept[0])
    # A rank reads its own state from the file; the next step is the uninterrupted run's, bit for bit.
    b = Learner(ModelConfig(dropout=0.1), None, RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0),
                init_checkpoint=str(path), rank=0, world_size=1, total_steps=20, seed=0, max_source_len=32,
                max_target_len=16)
    b.load_training_state_from(str(path))
    b.train_step(_pairs(8))
    wb = b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="states and weights"):
        learner.write_checkpoint(str(tmp_path / "ckpt"), "step-000002", 2, {}, [], [0, 1], kept[0])


def test_learner_ranks_pick_their_items_out_of_scored_chunks_by_reference():
    calls: list = []
    ranks = [SimpleNamespace(train_step_stored=_Remote(calls, f"rank{i}", lambda *a: "step-ref")) for i in range(2)]
    group = object.__new__(groups.LearnerGroup)
    group.ranks, group._joining, group._preflight, group._loading = ranks, [], [], []
    group._masks_held = [None, None]
    items = [StoredItem(5, 0, "a", 0), StoredItem(5, 1, "b", 0), StoredItem(7, 0, "c", 0, mask_version=2),
             StoredItem(5, 2, "d", 0)]
    refs = group.train_step_async(items, {5: "chunk5", 7: "chunk7"}, published={2: "mask2"})
    assert refs == ["step-ref", "step-ref"]
    # rank 0: items 0 and 2 (chunks 5 and 7); rank 1: items 1 and 3 (chunk 5 only): references, never items
    assert calls == [("rank0", ([(0, 0), (1, 0)], [2], "chunk5", "chunk7", "mask2"), {}),
                     ("rank1", ([(0, 1), (0, 2)], [], "chunk5"), {})]
    # what the rank does with them: the items picked, in order, and the masking policies after the chunks
    seen = SimpleNamespace(train_step=lambda items, versions, *masks: (items, versions, masks))
    got = Learner.train_step_stored(seen, [(0, 0), (1, 0), (0, 2)], [2], ["a", "b", "d"], ["c"], "mask2")  # type: ignore[arg-type]
    assert got == (["a", "c", "d"], [2], ("mask2",))


def test_the_ranks_validation_table_adds_the_text_metrics_of_eval_metrics():
    """RL's epoch table: the usual columns, then those of eval.metrics beyond them (a translation run's chrF),
    without the columns that need a model (test_learner.py: a rank computes what it is asked)."""
    from rlt2t.common.config import load_config

    calls: list = []
    group = object.__new__(groups.LearnerGroup)
    group.ranks = [SimpleNamespace(evaluate=_Remote(calls, "rank0", lambda *a: ({}, [])))]
    group._settle, group._get = lambda: None, lambda refs: refs
    cfg = load_config([], ["eval.metrics=[chrf,task_score,perplexity,sacrebleu]"])
    group.evaluate([], cfg)
    assert calls[0][1][3] == ["cider_d", "bleu4", "task_score", "rouge_l", "mean_length", "chrf", "sacrebleu"]
    # what a rank cannot compute is eval's to check, not RL's to fail on: a typo, a metric of the user's
    from rlt2t.common.metrics import _REGISTRY, register_metric

    register_metric("mine")(lambda: None)
    try:
        cfg.eval.metrics = ["blue", "mine", "chrf"]
        group.evaluate([], cfg)
    finally:
        del _REGISTRY["mine"]
    assert calls[1][1][3] == ["cider_d", "bleu4", "task_score", "rouge_l", "mean_length", "chrf"]


def test_worker_results_come_with_the_summary_the_driver_reads():
    class Rollouts(by_reference.RolloutsByReference):
        def sample_version(self, version, weights, examples):
            return [f"set-{e}" for e in examples]

    class Rewards(by_reference.RewardsByReference):
        def score(self, items):
            return _pairs(len(items))

    assert Rollouts().sample_version_stored(0, None, ["x", "y"]) == (2, ["set-x", "set-y"])
    summary, scored = Rewards().score_stored(["set-x", "set-y"])
    assert summary == [("0", 0, None), ("1", 0, None)] and scored == _pairs(2)
    assert by_reference.stored_items(3, summary) == [StoredItem(3, 0, "0", 0), StoredItem(3, 1, "1", 0)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_task_loads_the_start_weights_and_their_reference_as_separate_loads_would(tmp_path, tiny_policy, lora):
    """An RL job's first published version and the KL reference come from one task (one process's imports, and
    one load when a fresh run starts from its reference); another start checkpoint (a resumed run's) is loaded
    beside the reference, and a job that needs no reference gets none."""
    init, start = tmp_path / "init", tmp_path / "start"
    for path in (init, start):
        tiny_policy.tokenizer.save_pretrained(path)
    tiny_policy.model.save_pretrained(init)
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p.add_(0.5)
    tiny_policy.model.save_pretrained(start)
    cfg = ModelConfig(lora=LoraConfig(enabled=lora, r=4, alpha=8, dropout=0.0))

    def plain(path: Path) -> dict[str, torch.Tensor]:
        return load_policy(ModelConfig(), checkpoint=path).model.state_dict()

    def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    for checkpoint in (init, start):
        alone = groups._start_weights(cfg, None, str(checkpoint), 3, None)
        assert alone[2:] == (None, None)
        tokenizer, weights, count, base = groups._start_weights(cfg, None, str(checkpoint), 3, str(init))
        assert tokenizer.get_vocab() == tiny_policy.tokenizer.get_vocab()
        assert equal(weights, alone[1])  # the same first version, with or without its reference
        reference = load_policy(ModelConfig(), checkpoint=init).model
        assert equal(base, reference.state_dict()) and count == sum(p.numel() for p in reference.parameters())
        if lora:  # the adapters (seeded), not the base
            assert weights and all("lora_" in k for k in weights)
        else:
            assert equal(weights, plain(checkpoint))
    assert not equal(plain(start), plain(init))


def _adapter_checkpoint(tmp_path: Path, tokenizer_dir: Path, lora: LoraConfig) -> tuple[Path, Path]:
    """(base model dir, a LoRA SFT checkpoint on it whose adapters change the outputs)."""
    from rlt2t.common.checkpoint import save_checkpoint
    from rlt2t.common.lora import apply_lora
    from rlt2t.common.tokenization import save_tokenizer

    base = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), tokenizer_dir, seed=0)
    base_dir = tmp_path / "base"
    base.model.save_pretrained(base_dir)
    save_tokenizer(base.tokenizer, base_dir)
    model = apply_lora(load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=base_dir).model, lora)
    model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # adapters that change the outputs
                p.copy_(torch.randn(p.shape, generator=gen))
    return base_dir, save_checkpoint(tmp_path / "sft", "epoch-0001", model=model, tokenizer=base.tokenizer, step=1)


def test_lora_rl_from_an_adapter_checkpoint_samples_the_learners_policy(tmp_path, ids_tokenizer_dir):
    """RL with LoRA from a LoRA SFT checkpoint trains its adapters on: the rollout workers get the adapters' base
    (not the checkpoint merged, to which the published adapters would be added a second time), so that base +
    published adapters is the learner's policy, and the KL reference (adapters disabled) is that base."""
    from rlt2t.actors.rollout import RolloutWorker
    from rlt2t.common.config import RolloutConfig
    from rlt2t.common.lora import merged_model
    from rlt2t.common.types import RolloutSpec

    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    base_dir, sft = _adapter_checkpoint(tmp_path, ids_tokenizer_dir, lora)
    cfg = ModelConfig(preset="tiny", family="bart", dropout=0.0, lora=lora)
    _, weights, _, start = groups._start_weights(cfg, None, str(sft), 3, str(sft))
    assert all("lora_" in k for k in weights)  # the first version publishes the SFT adapters, to train on
    plain = load_policy(ModelConfig(preset=None), checkpoint=base_dir).model
    assert start is not None and start.keys() == plain.state_dict().keys()
    assert all(torch.equal(start[k], v) for k, v in plain.state_dict().items())  # the base, not merged

    worker = RolloutWorker(cfg, str(ids_tokenizer_dir), RolloutConfig(max_new_tokens=4), seed=3, max_source_len=16,
                           spec=RolloutSpec("group", reference=True), start_weights=start)
    worker.set_weights(1, weights)
    sampled = merged_model(worker.policy.model).state_dict()
    learner = load_policy(ModelConfig(preset=None), checkpoint=sft).model.state_dict()  # base + SFT adapters
    assert sampled.keys() == learner.keys()
    assert all(torch.allclose(sampled[k], learner[k], atol=1e-6) for k in learner)


def test_lora_rl_refuses_a_kl_reference_on_another_base(tmp_path, ids_tokenizer_dir):
    from rlt2t.common.config import load_config
    from rlt2t.jobs import rl_job

    lora = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)
    base_dir, sft = _adapter_checkpoint(tmp_path, ids_tokenizer_dir, lora)
    other = tmp_path / "other"
    load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=1).model.save_pretrained(other)
    cfg = load_config([], [f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true"])
    with pytest.raises(ValueError, match=rf"model\.lora: the adapters trained from {sft} adapt {base_dir.resolve()}, "
                                         rf"but the KL reference {other} is {other} with LoRA"):
        rl_job(cfg, init=sft, reference=other)
