"""Policy-gradient algorithms end to end without Ray: a real RolloutWorker samples groups, a RewardWorker
scores them, a Learner (world size 1) takes the step. The learner's log-probs must reproduce the sampler's
on-policy (ratio 1), every algorithm must train, and the learner state must round-trip bitwise."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.algorithms import algorithm as unit_of
from rlt2t.common.algorithms import names, rollout_spec_for
from rlt2t.common.config import ModelConfig, RewardConfig, RLConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.lora import policy_weights
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.policy import load_policy
from rlt2t.common.types import RolloutSpec
from rlt2t.learner.learner import Learner

MODEL = ModelConfig(preset="tiny", family="bart", dropout=0.1)  # dropout in the config: the PG learner must turn it off
EXAMPLES = [Example(id=f"ex{i}", source=" ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i % 4)),
                    target=" ".join(str(10 + (i * 3 + j) % 50) for j in range(2 + i % 3))) for i in range(8)]


@pytest.fixture(scope="module")
def init_dir(ids_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny BART with wide weights (its samples depend on the source and vary) saved as a checkpoint."""
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / param.shape[-1] ** 0.5)
        policy.model.final_logits_bias[0, policy.tokenizer.eos_token_id] = 1.5
    out = tmp_path_factory.mktemp("init")
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    return out


def _rollout(init_dir: Path, rollout: RolloutConfig, spec: RolloutSpec) -> RolloutWorker:
    weights = load_policy(MODEL, checkpoint=init_dir).model.state_dict()
    worker = RolloutWorker(MODEL, str(init_dir), rollout, seed=3, max_source_len=16, spec=spec,
                           start_weights=weights if spec.reference else None)
    worker.set_weights(0, weights)
    return worker


def _learner(init_dir: Path, rl: RLConfig, rollout: RolloutConfig) -> Learner:
    return Learner(MODEL, None, rl, rollout, init_checkpoint=str(init_dir), rank=0, world_size=1, total_steps=10,
                   seed=0, max_source_len=16, max_target_len=16)


def _scored(worker: RolloutWorker, examples=EXAMPLES):
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in EXAMPLES]))
    return reward.score(worker.sample(examples))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_on_policy_ratio_is_one_for_the_torch_sampler(init_dir, temperature, top_k, top_p):
    rollout = RolloutConfig(num_samples=4, top_k=top_k, top_p=top_p, temperature=temperature, max_new_tokens=8)
    rl = RLConfig(algorithm="grpo", batch_size=8, lr=1e-3)
    groups = _scored(_rollout(init_dir, rollout, rollout_spec_for("grpo", kl=True)))
    metrics = _learner(init_dir, rl, rollout).train_step(groups)
    assert metrics["sampler_ratio_max_dev"] < 1e-4, metrics
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # The sampler's and the learner's (pre-step) raw log-probs agree, so the KL to the unchanged start is ~0.
    assert abs(metrics["kl_k1"]) < 1e-4 and metrics["kl_k3"] < 1e-6


def test_on_policy_ratio_is_one_for_the_ct2_float32_sampler_and_int8_differs(init_dir):
    rollout = RolloutConfig(num_samples=4, top_k=5, temperature=0.8, max_new_tokens=8, backend="ct2",
                            ct2_compute_type="float32")
    rl = RLConfig(algorithm="rloo", batch_size=8, lr=1e-3)
    spec = rollout_spec_for("rloo", kl=True)
    metrics = _learner(init_dir, rl, rollout).train_step(_scored(_rollout(init_dir, rollout, spec)))
    assert metrics["sampler_ratio_max_dev"] < 1e-3, metrics
    # with a nucleus too (rollout.top_p): CTranslate2's filter is the learner's, no drawn token falls outside it
    nucleus = rollout.model_copy(update={"top_k": 0, "top_p": 0.7, "temperature": 1.3})
    metrics_p = _learner(init_dir, rl, nucleus).train_step(_scored(_rollout(init_dir, nucleus, spec)))
    assert metrics_p["sampler_ratio_max_dev"] < 1e-3 and metrics_p["excluded_tokens"] == 0, metrics_p
    int8 = rollout.model_copy(update={"ct2_compute_type": "int8"})
    metrics8 = _learner(init_dir, rl, int8).train_step(_scored(_rollout(init_dir, int8, spec)))
    # int8 weights draw from a slightly different distribution: the truncated importance weights see it
    assert metrics8["sampler_ratio_max_dev"] > metrics["sampler_ratio_max_dev"]


def test_rollout_groups_carry_what_each_algorithm_needs(init_dir):
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=6)
    groups = _rollout(init_dir, rollout, rollout_spec_for("scst", kl=True)).sample(EXAMPLES[:2])
    for g in groups:
        assert len(g.candidates) == 3 and g.greedy is not None and g.reference_logprobs is not None
        for ids, lps, forced in zip(g.token_ids, g.sample_logprobs, g.forced_eos, strict=True):
            assert 1 <= len(ids) <= 6 and len(lps) == len(ids)
            assert forced == (len(ids) == 6)  # BART forces EOS at the limit
    plain = _rollout(init_dir, rollout, rollout_spec_for("ppo", kl=False)).sample(EXAMPLES[:2])
    assert all(g.greedy is None and g.reference_logprobs is None for g in plain)
    # same seed, version and ids: the same samples (rollouts are a function of those alone)
    assert [g.token_ids for g in plain] == [g.token_ids for g in groups]


@pytest.mark.parametrize("algorithm", [a for a in names() if unit_of(a).data == "groups"])
def test_every_algorithm_trains_and_logs(init_dir, algorithm):
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm=algorithm, batch_size=8, lr=3e-3, kl={"coef": 0.1, "target": 1.0, "horizon": 100},
                  pg={"nlpo_top_p": 0.95, "nlpo_mask_refresh_steps": 1, "target_kl": 0})
    spec = rollout_spec_for(algorithm, kl=rl.uses_kl, mask_top_p=rl.pg.nlpo_top_p)
    worker = _rollout(init_dir, rollout, spec)
    learner = _learner(init_dir, rl, rollout)
    before = learner.weights()
    for step in range(2):
        if algorithm == "nlpo":
            worker.mask_model = copy.deepcopy(worker.policy.model)  # the masking policy: the current weights
            worker.mask_model.load_state_dict(learner.objective.mask_model.state_dict())
        metrics = learner.train_step(_scored(worker))
        worker.set_weights(step + 1, learner.weights())
    for key in ("loss", "reward_mean", "kl_k1", "kl_k3", "kl_coef", "clip_fraction", "approx_kl", "entropy",
                "advantage_mean", "ratio_mean", "sampler_ratio_max_dev", "grad_norm", "step_s", "lr"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
    assert metrics["sampler_ratio_max_dev"] < 1e-4  # every batch was sampled on-policy
    after = learner.weights()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    epochs = 1 if algorithm in ("scst", "rloo", "grpo", "a2c", "trpo") else 2
    minibatches = 1 if algorithm in ("scst", "rloo", "grpo", "a2c", "trpo") else 2
    assert metrics["optimizer_steps"] == epochs * minibatches
    if algorithm in ("ppo", "a2c", "nlpo", "trpo"):
        assert {"value_loss", "explained_variance"} <= set(metrics)
    if algorithm == "scst":
        assert "greedy_reward" in metrics
    assert metrics["kl_coef"] != 0.1  # the adaptive controller moved it


@pytest.mark.parametrize("shard", [5, 4])
def test_ranks_with_uneven_shards_take_the_same_number_of_optimizer_steps(init_dir, shard):
    """An epoch's tail splits unevenly (9 sources over 2 ranks: 5 and 4). DDP all-reduces every backward, so
    both ranks must take rl.pg.minibatches steps: 5 sources in 3 parts is [2, 2, 1], and 4 must be [2, 1, 1]
    (torch.chunk gave [2, 2], one step short, and the ranks' collectives no longer matched)."""
    rollout = RolloutConfig(num_samples=2, top_k=0, max_new_tokens=6)
    rl = RLConfig(algorithm="ppo", batch_size=9, learners=2, kl={"coef": 0.0},
                  pg={"epochs": 1, "minibatches": 3, "target_kl": 0.0})
    learner = _learner(init_dir, rl, rollout)
    learner.all_min = lambda value: 4  # what the all-reduce over both ranks' shard sizes (5, 4) returns
    metrics = learner.train_step(_scored(_rollout(init_dir, rollout, rollout_spec_for("ppo", kl=False)),
                                         EXAMPLES[:shard]))
    assert metrics["optimizer_steps"] == 3


def test_ppo_state_round_trip_continues_bitwise(init_dir):
    """Value head, KL controller, optimizer, schedule and RNG all come back: the next step is identical."""
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm="ppo", batch_size=8, lr=3e-3, kl={"coef": 0.1, "target": 1.0, "horizon": 50})
    worker = _rollout(init_dir, rollout, rollout_spec_for("ppo", kl=True))
    batches = [_scored(worker, EXAMPLES[:4]), _scored(worker, EXAMPLES[4:])]
    a = _learner(init_dir, rl, rollout)
    a.train_step(batches[0])
    state, weights = a.training_state(), a.weights()
    assert state["objective"]["kl"]["coef"] != 0.1 and "value_head" in state["objective"]
    ma = a.train_step(batches[1])
    b = _learner(init_dir, rl, rollout)
    b.policy.model.load_state_dict(weights)
    b.load_training_state(state)
    mb = b.train_step(batches[1])
    wa, wb = a.weights(), b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert ma["value_loss"] == mb["value_loss"] and ma["kl_coef"] == mb["kl_coef"]


def test_stale_tokens_outside_the_new_top_k_leave_the_loss_without_nan(init_dir):
    """With top-k sampling, a stale sample may hold tokens the updated policy's top-k no longer contains: they
    have no ratio (-inf log-probs) and must leave the loss, not turn it into NaN."""
    rollout = RolloutConfig(num_samples=4, top_k=2, temperature=1.0, max_new_tokens=8)
    rl = RLConfig(algorithm="grpo", batch_size=8, lr=5e-2, warmup_ratio=0.0)
    groups = _scored(_rollout(init_dir, rollout, rollout_spec_for("grpo", kl=True)))
    learner = _learner(init_dir, rl, rollout)
    excluded = 0.0
    for _ in range(4):  # a large learning rate moves the policy: the same (now stale) samples again
        metrics = learner.train_step(groups)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        excluded = max(excluded, metrics["excluded_tokens"])
    assert excluded > 0, "the test did not produce tokens outside the new top-k"


def test_lora_trains_adapters_only_publishes_them_and_the_reference_is_the_base(init_dir):
    """model.lora: the learner trains and publishes the adapters alone, the rollout worker applies them to its
    copy of the base (shipped once) and samples on-policy, and the KL's reference is the base, adapters off."""
    lora_model = ModelConfig(preset="tiny", family="bart", dropout=0.1,
                             lora={"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0})
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm="grpo", batch_size=8, lr=5e-3, warmup_ratio=0.0, kl={"coef": 0.1})
    learner = Learner(lora_model, None, rl, rollout, init_checkpoint=str(init_dir), rank=0, world_size=1,
                      total_steps=10, seed=0, max_source_len=16, max_target_len=16)
    base_before = {k: v.clone() for k, v in learner.policy.model.get_base_model().state_dict().items()
                   if "lora_" not in k}
    published = learner.weights()
    assert published and all("lora_" in k for k in published)
    full = load_policy(MODEL, checkpoint=init_dir).model.state_dict()
    assert sum(t.numel() for t in published.values()) < 0.2 * sum(t.numel() for t in full.values())
    worker = RolloutWorker(lora_model, str(init_dir), rollout, seed=3, max_source_len=16,
                           spec=rollout_spec_for("grpo", kl=True), start_weights=full)
    worker.set_weights(0, published)
    first = learner.train_step(_scored(worker))
    assert first["kl_k1"] == pytest.approx(0.0, abs=1e-6)  # adapters start at zero: the policy is the base
    worker.set_weights(1, learner.weights())  # the adapter-only publish, received and applied
    second = learner.train_step(_scored(worker))
    assert second["sampler_ratio_max_dev"] < 1e-4, second  # the worker samples exactly the learner's policy
    assert second["kl_k3"] > 0  # the policy moved away from its reference, the base
    base_after = {k: v for k, v in learner.policy.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before), "the frozen base changed"


@pytest.mark.parametrize("lora", [False, True])
def test_start_weights_may_come_with_the_first_sampling_call_and_are_fetched_once(init_dir, lora):
    """The Ray launch gives rollout workers no start weights in their constructor (Ray keeps constructor arguments
    for restarts and logs an error about object-store ones): each sampling call carries a fetcher instead, called
    once. The samples and reference log-probs equal a worker's that got the weights in its constructor."""
    model = ModelConfig(preset="tiny", family="bart", dropout=0.1,
                        lora={"enabled": lora, "r": 4, "alpha": 8.0, "dropout": 0.0})
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8)
    spec = rollout_spec_for("grpo", kl=True)
    full = load_policy(MODEL, checkpoint=init_dir).model.state_dict()
    eager = RolloutWorker(model, str(init_dir), rollout, seed=3, max_source_len=16, spec=spec, start_weights=full)
    published = {k: v * 0.99 + 0.01 for k, v in policy_weights(eager.policy.model).items()}  # LoRA: adapters
    lazy = RolloutWorker(model, str(init_dir), rollout, seed=3, max_source_len=16, spec=spec)
    assert lazy.needs_start
    with pytest.raises(ValueError, match="start weights"):
        lazy.sample_version(1, published, EXAMPLES)
    fetched = []

    def fetch():
        fetched.append(1)
        return full

    for _ in range(2):
        got = lazy.sample_version(1, published, EXAMPLES, start_weights=fetch)
    assert fetched == [1] and not lazy.needs_start
    want = eager.sample_version(1, published, EXAMPLES)
    assert [g.candidates for g in got] == [g.candidates for g in want]
    assert [g.reference_logprobs for g in got] == [g.reference_logprobs for g in want]


def test_mismatched_generation_settings_and_a_wrong_reference_are_warned_about(init_dir, caplog):
    """What peers' trackers show runs dying of: on-policy ratios away from 1 (the learner's transform is not
    the sampler's) and a negative KL estimate (the reference or the samples are not what they should be)."""
    import dataclasses

    sampler = RolloutConfig(num_samples=4, top_k=0, temperature=1.0, max_new_tokens=8)
    learner_cfg = sampler.model_copy(update={"temperature": 0.5})  # the learner believes another temperature
    groups = _scored(_rollout(init_dir, sampler, rollout_spec_for("rloo", kl=True)))
    with caplog.at_level("WARNING", logger="rlt2t.learner"):
        _learner(init_dir, RLConfig(algorithm="rloo", batch_size=8), learner_cfg).train_step(groups)
    assert any("differ from the sampler's" in r.message for r in caplog.records)
    caplog.clear()
    # reference log-probs of 0 (probability 1 for every sampled token): log p - log r < 0 everywhere
    wrong = [dataclasses.replace(g, group=dataclasses.replace(g.group, reference_logprobs=tuple(
        tuple(0.0 for _ in ids) for ids in g.group.token_ids))) for g in groups]
    with caplog.at_level("WARNING", logger="rlt2t.learner"):
        metrics = _learner(init_dir, RLConfig(algorithm="rloo", batch_size=8), sampler).train_step(wrong)
    assert metrics["kl_k1"] < 0
    assert any("KL estimate to the reference is negative" in r.message for r in caplog.records)
    assert not any("differ from the sampler's" in r.message for r in caplog.records)


def test_a_negative_kl_is_warned_about_on_stale_samples_without_blaming_the_staleness(init_dir, caplog):
    """A pipelined run samples one step behind the learner, so the warning cannot wait for on-policy steps
    (NLPO collapsed in the benchmark with samples one step stale and a k1 of -4 nats a token, unwarned). The
    negative k1 that staleness causes, at most the sampler's KL to the learner, must not trigger it."""
    import dataclasses

    sampler = RolloutConfig(num_samples=4, top_k=0, temperature=1.0, max_new_tokens=8)
    worker = _rollout(init_dir, sampler, rollout_spec_for("rloo", kl=True))
    learner = _learner(init_dir, RLConfig(algorithm="rloo", batch_size=8, lr=1e-2, warmup_ratio=0.0), sampler)
    learner.train_step(_scored(worker))  # step 0; the worker keeps sampling version 0
    stale = _scored(worker)
    assert all(g.policy_version == 0 for g in stale)
    with caplog.at_level("WARNING", logger="rlt2t.learner"):
        metrics = learner.train_step(stale)  # step 1, samples of the start policy, the reference
    # k1 = E_q[log p - log q] with q the start policy: negative, but no lower than minus the sampler's KL to
    # the learner (up to noise; k1 also counts the EOS forced at the length limit, which was not sampled)
    assert metrics["sampler_kl"] > 0.01, metrics
    assert -metrics["sampler_kl"] - 3 * metrics["kl_k1_stderr"] <= metrics["kl_k1"] < 0, metrics
    assert not any("KL estimate to the reference is negative" in r.message for r in caplog.records)
    wrong = [dataclasses.replace(g, group=dataclasses.replace(g.group, reference_logprobs=tuple(
        tuple(0.0 for _ in ids) for ids in g.group.token_ids))) for g in stale]
    with caplog.at_level("WARNING", logger="rlt2t.learner"):
        metrics = learner.train_step(wrong)  # step 2, two steps stale, and a reference that is not the start
    assert metrics["kl_k1"] < -(metrics["sampler_kl"] + 0.01)
    assert any("KL estimate to the reference is negative" in r.message for r in caplog.records)


def test_nlpo_leak_term_keeps_the_policy_mass_inside_the_mask(init_dir):
    """NLPO's masked loss never reaches the logits of masked-out tokens; with rl.pg.nlpo_leak_coef at 0 nothing
    holds their mass (a benchmark seed collapsed once a mask refresh let the drifted tokens in). The term pulls
    mass back inside: after a step with it, less of the policy's mass is outside than after one without."""
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    leaks = {}
    for coef in (0.0, 10.0):
        rl = RLConfig(algorithm="nlpo", batch_size=8, lr=3e-3,
                      pg={"nlpo_top_p": 0.5, "nlpo_mask_refresh_steps": 100, "target_kl": 0, "nlpo_leak_coef": coef})
        worker = _rollout(init_dir, rollout, rollout_spec_for("nlpo", kl=rl.uses_kl, mask_top_p=0.5))
        learner = _learner(init_dir, rl, rollout)
        worker.mask_model = copy.deepcopy(worker.policy.model)
        worker.mask_model.load_state_dict(learner.objective.mask_model.state_dict())
        groups = _scored(worker)
        first = learner.train_step(groups)
        leaks[coef] = (first["mask_leak"], learner.train_step(groups)["mask_leak"])
    # each value is the mean over a step's 4 optimizer steps; the first step's starts from the same weights
    assert leaks[0.0][0] > 0.1  # a top-0.5 mask leaves real mass outside
    assert leaks[10.0][1] < leaks[0.0][1] - 0.05, leaks


def test_nlpo_learner_masks_each_group_with_the_masking_policy_it_was_sampled_under(init_dir):
    """Groups of one batch sampled under two masking-policy versions (a pipelined run lags the learner across a
    mask refresh): the learner, sent both versions' weights, masks each group with its own, so on-policy every
    ratio is 1. With one mask for the whole batch the other version's groups would be off."""
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm="nlpo", batch_size=8, lr=3e-3, pg={"nlpo_top_p": 0.5, "target_kl": 0})
    worker = _rollout(init_dir, rollout, rollout_spec_for("nlpo", kl=rl.uses_kl, mask_top_p=0.5))
    learner = _learner(init_dir, rl, rollout)
    start = {k: v.clone() for k, v in worker.policy.model.state_dict().items()}
    gen = torch.Generator().manual_seed(5)
    other = {k: v + 0.5 * torch.randn(v.shape, generator=gen) if v.is_floating_point() and v.dim() >= 2 else v
             for k, v in start.items()}  # a masking policy far from the start: its top-p sets differ
    old = worker.sample_version(0, start, EXAMPLES[:4], mask_version=0, mask_weights=start)
    new = worker.sample_version(0, start, EXAMPLES[4:], mask_version=10, mask_weights=other)
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in EXAMPLES]))
    groups = reward.score(old) + reward.score(new)
    assert {g.mask_version for g in groups} == {0, 10}
    with pytest.raises(RuntimeError, match="masking-policy version 10, whose weights the learner was not sent"):
        learner.train_step(groups, [0], start)
    learner = _learner(init_dir, rl, rollout)
    metrics = learner.train_step(groups, [0, 10], start, other)
    assert metrics["sampler_ratio_max_dev"] < 1e-4, metrics["sampler_ratio_max_dev"]
    assert metrics["excluded_tokens"] == 0
    # the same groups masked with one policy (the learner's start copy) for all: the later version's are off
    unversioned = [dataclasses.replace(g, group=dataclasses.replace(g.group, mask_version=None)) for g in groups]
    one_mask = _learner(init_dir, rl, rollout).train_step(unversioned)
    assert one_mask["sampler_ratio_max_dev"] > 0.01 or one_mask["excluded_tokens"] > 0


@pytest.mark.parametrize("algorithm,source", [("nlpo", "ray"), ("grpo", "http")])
def test_preflight_covers_the_mask_and_reference_passes_and_leaves_training_unchanged(init_dir, algorithm, source):
    """A step holds more than the policy's pass: NLPO's masking-policy forward and its [K*B, T, V] mask, and,
    for samples from policy servers (no reference log-probs), the learner's reference pass. The preflight
    runs them too, so their memory is in the out-of-memory check; afterwards training is bitwise the same."""
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8, source=source)
    rl = RLConfig(algorithm=algorithm, batch_size=8, lr=3e-3, pg={"target_kl": 0})
    worker = _rollout(init_dir, RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8),
                      rollout_spec_for(algorithm, kl=rl.uses_kl and source == "ray", mask_top_p=0.9))
    groups = _scored(worker)
    if source == "http":
        assert all(g.group.reference_logprobs is None for g in groups)  # as a policy server sends them
    losses = []
    for preflight in (False, True):
        learner = _learner(init_dir, rl, rollout)
        extra = learner.objective.mask_model if algorithm == "nlpo" else learner.objective.reference
        assert extra is not None
        calls = []
        hook = extra.register_forward_hook(lambda m, i, o, calls=calls: calls.append(1))
        if preflight:
            stats = learner.preflight()
            assert len(calls) == 1 and stats["peak_memory_gib"] > 0  # the extra pass ran on the largest batch
            assert all(p.grad is None for p in learner.policy.model.parameters())
        hook.remove()
        losses.append([learner.train_step(groups)["loss"] for _ in range(2)])
    assert losses[0] == losses[1]


def test_the_frozen_models_follow_the_learner_to_its_device(init_dir, monkeypatch):
    """The reference (samples from policy servers) and NLPO's masking policy are not part of the trained module
    that accelerate places; the learner moves them to its device too (on a GPU they stayed on the CPU, and
    the first step that used them failed on a device mismatch)."""
    rl = RLConfig(algorithm="nlpo", batch_size=8)
    learner = _learner(init_dir, rl, RolloutConfig(num_samples=3, max_new_tokens=8, source="http"))
    frozen = learner.objective.frozen_modules()
    assert frozen == [learner.objective.reference, learner.objective.mask_model] and None not in frozen
    moved = []
    for module in frozen:
        monkeypatch.setattr(module, "to", lambda device, module=module: moved.append((module, device)) or module)
    acc = learner._prepare()
    assert moved == [(module, acc.device) for module in frozen]
    assert _learner(init_dir, RLConfig(algorithm="grpo", batch_size=8),
                    RolloutConfig(num_samples=3, max_new_tokens=8)).objective.frozen_modules() == []


def test_step_scalars_over_ranks_average_but_counts_add_and_maxima_stay_maxima(init_dir):
    # A second rank stood in for: its scalars are this rank's doubled (the all-reduces return the reduction).
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm="grpo", batch_size=8, lr=3e-3)
    worker = _rollout(init_dir, rollout, rollout_spec_for("grpo", kl=rl.uses_kl))
    groups = _scored(worker)
    alone = _learner(init_dir, rl, rollout).train_step(groups)
    learner = _learner(init_dir, rl, rollout)
    learner._prepare()  # set up as the one-process world it is
    learner.world_size = 2
    learner.all_sum = lambda v: v + 2 * v
    learner.all_max = lambda v: torch.maximum(v, 2 * v)
    learner.all_min = lambda value: value
    two = learner.train_step(groups)
    assert two["loss"] == pytest.approx(1.5 * alone["loss"], rel=1e-6)  # the mean of x and 2x
    assert two["tokens"] == pytest.approx(3 * alone["tokens"])  # x + 2x
    assert two["ratio_max"] == pytest.approx(2 * alone["ratio_max"], rel=1e-6)  # max(x, 2x)


def test_under_mixed_precision_the_reference_pass_matches_the_policy_and_values_stay_float32(init_dir):
    """Under bf16 autocast (CUDA runs; exercised with CPU autocast) the policy's pass is autocast, but the learner's
    own reference pass (the LoRA base, adapters off) ran in float32: at step 0, policy = reference, the KL was
    1e-3 per token instead of 0. And the value head's product ran in bf16, rounding the critic's values."""
    import dataclasses as dc

    from accelerate.state import AcceleratorState

    from rlt2t.learner.group_step import ValueHead

    head = ValueHead(16)
    torch.nn.init.normal_(head.linear.weight, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = head(hidden)
    assert values.dtype == torch.float32 and torch.equal(values, head(hidden))

    lora_model = ModelConfig(preset="tiny", family="bart", dropout=0.1,
                             lora={"enabled": True, "r": 4, "alpha": 8.0, "dropout": 0.0})
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm="grpo", batch_size=8, lr=5e-3, warmup_ratio=0.0, kl={"coef": 0.1})
    full = load_policy(MODEL, checkpoint=init_dir).model.state_dict()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        learner = Learner(lora_model, None, rl, rollout, init_checkpoint=str(init_dir), rank=0, world_size=1,
                          total_steps=10, seed=0, max_source_len=16, max_target_len=16)
        learner.mixed_precision = "bf16"
        assert learner._prepare().mixed_precision == "bf16"
        worker = RolloutWorker(lora_model, str(init_dir), rollout, seed=3, max_source_len=16,
                               spec=rollout_spec_for("grpo", kl=True), start_weights=full)
        worker.set_weights(0, learner.weights())
        # without the worker's reference log-probs, the learner scores the reference itself (its LoRA base)
        groups = [dc.replace(g, group=dc.replace(g.group, reference_logprobs=None)) for g in _scored(worker)]
        metrics = learner.train_step(groups)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert metrics["kl_k1"] == 0.0 and metrics["kl_k3"] == 0.0


def test_a_resume_follows_the_configured_kl_target(init_dir, caplog):
    """The checkpoint's KL controller kept its own target: a run resumed with rl.kl.target=null (a fixed β) went
    on adapting β. The coefficient carries over; the target is the config's, with a warning when they differ."""
    rollout = RolloutConfig(num_samples=2)
    adaptive = _learner(init_dir, RLConfig(algorithm="grpo", kl={"coef": 0.1, "target": 1.0}), rollout)
    adaptive.objective.kl.update(5.0, 50)
    state = adaptive.objective.state_dict()
    coef = state["kl"]["coef"]
    assert coef > 0.1
    fixed = _learner(init_dir, RLConfig(algorithm="grpo", kl={"coef": 0.1}), rollout)
    with caplog.at_level("WARNING", logger="rlt2t.learner"):
        fixed.objective.load_state_dict(state)
    assert fixed.objective.kl.target is None and fixed.objective.kl.coef == coef
    assert fixed.objective.kl.update(5.0, 50) == coef  # fixed from here on
    assert "rl.kl.target" in caplog.text
    same = _learner(init_dir, RLConfig(algorithm="grpo", kl={"coef": 0.1, "target": 1.0}), rollout)
    caplog.clear()
    same.objective.load_state_dict(state)
    assert same.objective.kl.coef == coef and same.objective.kl.target == 1.0 and not caplog.text


def _users_unit(init_dir: Path, tmp_path: Path, monkeypatch, module: str, code: str, unit: str):
    """A unit of one's own: ``code`` saved as ``module`` on the path, ``rl.algorithm=module:unit``; its
    RLConfig, a learner rank of it and a batch of scored groups."""
    import sys

    from rlt2t.common import algorithms

    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(algorithms, "_loaded", {})
    monkeypatch.delitem(sys.modules, module, raising=False)
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm=f"{module}:{unit}", batch_size=8, lr=3e-3)
    return rl, _learner(init_dir, rl, rollout), _scored(_rollout(init_dir, rollout, rl.rollout_spec))


USER_UNITS = '''
import torch

from rlt2t.learner.algorithms.base import PolicyGradient

class Centred(PolicyGradient):
    """REINFORCE with each source's mean reward as the baseline, no KL (a user's unit)."""
    name = "centred"
    uses_reference = False

    def advantages(self, rewards, **kw):
        BETAS.append(kw["beta"])
        return rewards - rewards.mean(dim=1, keepdim=True)

BETAS = []  # the beta each call of Centred.advantages got

class Flat(Centred):
    name = "flat"

    def advantages(self, rewards, **kw):
        return super().advantages(rewards, **kw).reshape(-1)  # [N*K]: each sample would get another's advantage

class Raises(Centred):
    name = "raises"

    def advantages(self, rewards, **kw):
        return rewards.centre()  # a typo: no such tensor method

class NotFinite(Centred):
    name = "not-finite"

    def advantages(self, rewards, **kw):
        return rewards * float("nan")

class Pooled(Centred):
    """Its baseline is the mean reward over every rank's batch (rlt2t's collective)."""
    name = "pooled"

    def advantages(self, rewards, *, all_sum, **kw):
        total = all_sum(torch.tensor([float(rewards.sum()), float(rewards.numel())], dtype=torch.float64))
        return rewards - float(total[0] / total[1])
'''


@pytest.mark.parametrize(("unit", "error", "message"), [
    ("Centred", None, None),
    ("Flat", ValueError, r"^rl.algorithm=user_pg:Flat: advantages returned \(32,\); it must return a tensor of the "
                         r"rewards' shape \[N sources, K samples\] = \(8, 4\)$"),
    ("NotFinite", ValueError, r"^rl.algorithm=user_pg:NotFinite: advantages returned non-finite advantages"),
    ("Raises", ValueError, r"^rl.algorithm=user_pg:Raises: Raises.advantages raised AttributeError: 'Tensor' object "
                           r"has no attribute 'centre' \(.*user_pg.py, line \d+\)$"),
])
def test_a_units_own_advantages_train_and_a_wrong_shape_or_nan_names_it(init_dir, tmp_path, monkeypatch, unit, error,
                                                                        message):
    import sys

    rl, learner, groups = _users_unit(init_dir, tmp_path, monkeypatch, "user_pg", USER_UNITS, unit)
    if error is None:
        before = learner.weights()
        metrics = learner.train_step(groups)
        assert metrics["kl_k1"] == 0.0 and metrics["advantage_std"] > 0  # no KL: uses_reference = False
        # nor a coefficient: the unit gets beta 0 and the logs say 0, not rl.kl.coef's unused value
        assert rl.kl.coef > 0 and metrics["kl_coef"] == 0.0 and sys.modules["user_pg"].BETAS == [0.0]
        assert any(not torch.equal(before[k], v) for k, v in learner.weights().items())
    else:
        with pytest.raises(error, match=message):
            learner.train_step(groups)


def test_the_algorithms_guides_own_unit_loads_reads_its_settings_and_trains(init_dir, tmp_path, monkeypatch):
    """docs/guides/algorithms.md, "An algorithm of your own": its code, as a user copies it."""
    import re
    import sys

    from rlt2t.common import algorithms
    from rlt2t.common.config import load_config

    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "algorithms.md").read_text()
    section = guide.split("## An algorithm of your own", 1)[1]
    (tmp_path / "my_algorithms.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(algorithms, "_loaded", {})
    monkeypatch.delitem(sys.modules, "my_algorithms", raising=False)
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    spreads = {}
    for scale in (1.0, 0.5):
        cfg = load_config(overrides=["rl.algorithm=my_algorithms:ScaledReinforce", f"rl.scaled_reinforce.scale={scale}",
                                     "rl.batch_size=8", "rl.lr=0.003"])
        groups = _scored(_rollout(init_dir, rollout, cfg.rl.rollout_spec))
        metrics = _learner(init_dir, cfg.rl, rollout).train_step(groups)
        assert metrics["kl_k1"] == 0.0  # uses_reference = False
        spreads[scale] = metrics["advantage_std"]
    assert spreads[0.5] == pytest.approx(spreads[1.0] / 2, rel=1e-5) and spreads[1.0] > 0


@pytest.mark.parametrize("unit", ["grpo", "Pooled"])
def test_a_collective_that_fails_inside_advantages_is_the_ranks_failure_not_the_units(init_dir, tmp_path, monkeypatch,
                                                                                      unit):
    """GRPO's batch scale, and a unit of one's own, sum over the ranks inside advantages: a peer rank gone there
    is a failed rank (which a resume recovers from), not an error in the unit's code."""
    import traceback

    from rlt2t.common.errors import UnitError

    if unit == "grpo":
        rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
        rl = RLConfig(algorithm="grpo", batch_size=8, lr=1e-3)  # rl.pg.grpo_scale=batch: all_sum in advantages
        learner = _learner(init_dir, rl, rollout)
        groups = _scored(_rollout(init_dir, rollout, rl.rollout_spec))
    else:
        _, learner, groups = _users_unit(init_dir, tmp_path, monkeypatch, "user_pg", USER_UNITS, unit)
    before = learner.weights()
    learner.train_step(groups)  # one rank: all_sum is the identity, and the unit trains
    assert any(not torch.equal(before[k], v) for k, v in learner.weights().items())

    # two ranks without their process group: torch.distributed's own error from the first collective, the one in
    # advantages (a stand-in raising in this file would be code of the user's, not the library's)
    monkeypatch.setattr(learner, "world_size", 2)
    with pytest.raises((RuntimeError, ValueError), match="process group") as e:
        learner.train_step(groups)
    assert not isinstance(e.value, UnitError)
    assert "advantages" in [frame.name for frame in traceback.extract_tb(e.value.__traceback__)]


OWN_OBJECTIVES = '''
from rlt2t.learner.algorithms.base import PolicyGradient


def total(batch):  # a helper of the user's, beside the unit
    return batch.rewardz.sum()  # a typo: a GroupBatch has rewards


class Base(PolicyGradient):
    uses_reference = False

    def advantages(self, rewards, **kw):
        return rewards - rewards.mean(dim=1, keepdim=True)

    def objective(self, rl, rollout, policy, *, seed, reference=None):
        from rlt2t.learner.objectives import PolicyGradientObjective

        unit = self

        class Objective(PolicyGradientObjective):
            def step(self, run, batch, items, step):
                return unit.step(run, batch)

        return Objective(rl, rollout, policy, seed=seed, reference=reference)


class Typo(Base):
    """Its objective's step fails in the user's helper."""
    name = "typo"

    def step(self, run, batch):
        return {"loss": float(total(batch))}


class Unbuilt(Base):
    """Its objective cannot be built."""
    name = "unbuilt"

    def objective(self, rl, rollout, policy, *, seed, reference=None):
        return OBJECTIVES[rl.algorithm]


OBJECTIVES = {}


class Sums(Base):
    """Its step sums over the ranks (rlt2t's collective)."""
    name = "sums"

    def step(self, run, batch):
        return {"loss": float(run.all_sum(batch.rewards.sum().reshape(1)))}
'''


def _line(text: str) -> int:
    """The line of OWN_OBJECTIVES that holds ``text``, as a traceback numbers it."""
    return 1 + next(i for i, line in enumerate(OWN_OBJECTIVES.splitlines()) if text in line)


@pytest.mark.parametrize(("unit", "fails", "message"), [
    ("Typo", ("train_step",), r"^rl.algorithm=user_own:Typo: total raised AttributeError: 'GroupBatch' object has "
                              rf"no attribute 'rewardz' \(\S*user_own.py, line {_line('batch.rewardz')}\)$"),
    # Ray hands the driver no exception of a rank's constructor: the rank starts and its first call raises it
    ("Unbuilt", ("join", "train_step", "training_state"),
     r"^rl.algorithm=user_own:Unbuilt: Unbuilt.objective raised KeyError: 'user_own:Unbuilt' \(\S*user_own.py, "
     rf"line {_line('OBJECTIVES[rl.algorithm]')}\)$"),
])
def test_an_error_in_a_units_own_objective_names_the_users_code_not_a_failed_rank(init_dir, tmp_path, monkeypatch,
                                                                                  unit, fails, message):
    """A unit of one's own with an objective of its own: an exception its code raises reaches the command line as
    one line naming the unit, the function and the line (groups.LearnerGroup passes a UnitError on as itself),
    not as a failed rank that a resume would repeat."""
    from rlt2t.common.errors import UnitError

    _, learner, groups = _users_unit(init_dir, tmp_path, monkeypatch, "user_own", OWN_OBJECTIVES, unit)
    calls = {"join": lambda: learner.join(("127.0.0.1", 0)), "train_step": lambda: learner.train_step(groups),
             "training_state": learner.training_state}
    for call in fails:
        with pytest.raises(UnitError, match=message):
            calls[call]()


def test_a_units_package_installed_beside_the_libraries_is_still_the_users_code(tmp_path, monkeypatch):
    """A unit shipped as a package installed into site-packages: an error in a helper module of that package is
    named at the helper's line, not at the unit's call into it (the rest of site-packages is libraries)."""
    import re
    import sys
    import sysconfig

    from rlt2t.learner.objectives import unit_fault

    site = tmp_path / "site-packages"
    (site / "mine").mkdir(parents=True)
    (site / "mine" / "__init__.py").write_text("")
    (site / "mine" / "helpers.py").write_text("def total(batch):\n    return batch.rewardz.sum()\n")
    (site / "mine" / "algos.py").write_text("from mine.helpers import total\n\n\nclass Unit:\n"
                                            "    def step(self, batch):\n        return total(batch)\n")
    monkeypatch.syspath_prepend(str(site))
    for name in ("mine", "mine.helpers", "mine.algos"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda key, *args, **kw: str(site) if key in ("purelib", "platlib")
                        else real(key, *args, **kw))
    from mine.algos import Unit

    with pytest.raises(AttributeError) as e:
        Unit().step(object())
    fault = str(unit_fault(Unit(), e.value))
    assert re.fullmatch(r"rl.algorithm=mine.algos:Unit: total raised AttributeError: 'object' object has no "
                        r"attribute 'rewardz' \(\S*site-packages/mine/helpers.py, line 2\)", fault), fault


def test_a_units_own_objective_failing_in_rlt2ts_collective_is_a_failed_rank(init_dir, tmp_path, monkeypatch):
    """What the user's code calls of rlt2t (the ranks' sum) failing is the rank's failure, which a resume may
    recover from, not the unit's: the error passes as it is."""
    from rlt2t.common.errors import UnitError

    _, learner, groups = _users_unit(init_dir, tmp_path, monkeypatch, "user_own", OWN_OBJECTIVES, "Sums")
    assert learner.train_step(groups)["loss"] == pytest.approx(sum(sum(g.rewards) for g in groups))

    # torch.distributed's all-reduce itself failing (here: a world of two without its process group)
    monkeypatch.setattr(learner, "world_size", 2)
    with pytest.raises(ValueError, match="process group") as e:
        learner.train_step(groups)
    assert not isinstance(e.value, UnitError)
