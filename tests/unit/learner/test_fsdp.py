"""The sharded learner (rl.strategy=fsdp) on two gloo ranks on the CPU: it takes the steps DDP takes (loss and
weights within 1e-5 over three steps, tiny BART and T5, GRPO, PPO, rank RL and DPO, a reference held in the
learner sharded as the policy is), holds about half the bytes per rank, and a checkpoint written mid-run (a
Hugging Face directory plus each rank's optimizer shard) resumes to the weights of the uninterrupted run."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.checkpoint import checkpoint_name, read_checkpoint
from rlt2t.common.config import Config, MetricConfig, ModelConfig, RewardConfig, RLConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.family_table import PRESET_FAMILIES, PRESETS
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.policy import load_policy
from rlt2t.common.types import PreferencePair
from rlt2t.learner.learner import Learner
from rlt2t.learner.sharding import layer_units, rank_bytes

ROLLOUT = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
# Samples from policy servers: no reference log-probs come with them, the learner scores its own reference.
HTTP_ROLLOUT = ROLLOUT.model_copy(update={"source": "http", "urls": ["http://127.0.0.1:1"]})
EXAMPLES = [Example(id=f"ex{i}", source=" ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i % 4)),
                    target=" ".join(str(10 + (i * 3 + j) % 50) for j in range(2 + i % 3))) for i in range(24)]
STEPS = 3


def _model(family: str, lora: bool = False) -> ModelConfig:
    adapters = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0} if lora else {}
    return ModelConfig(preset="tiny", family=family, dropout=0.0, lora=adapters)


def _rl(family: str, algorithm: str, strategy: str) -> RLConfig:
    # T5 also under the memory options (recomputed activations and gathered weights kept for the backward),
    # which change where the work happens, not the result.
    fsdp = {"activation_checkpointing": True, "reshard_after_forward": False} if family == "t5" else {}
    # lr 1e-3: at 3e-3 the wide tiny T5's third step is already unstable (gradient norm 160, clipped to 0.5) and
    # the reductions' round-off between the strategies grows to 2e-5 in its loss.
    return RLConfig(algorithm=algorithm, strategy=strategy, batch_size=8, learners=2, lr=1e-3,
                    kl={"coef": 0.1}, pg={"target_kl": 0.0}, fsdp=fsdp)


@pytest.fixture(scope="module")
def family_dir(request, wide_policy_dir) -> tuple[str, Path]:
    """A tiny policy of the family with wide weights (its samples vary), saved as a checkpoint."""
    return request.param, wide_policy_dir(_model(request.param))


def _batches(family: str, init_dir: Path, algorithm: str, path: Path) -> None:
    """STEPS global batches of scored groups (8 sources each), sampled once from the start policy and saved for
    the ranks: both strategies train on the same items. DPO: 8 preference pairs each (the gold target chosen
    over another example's)."""
    algorithm, _, variant = algorithm.partition("+")
    if algorithm == "dpo":
        torch.save([[PreferencePair(e.id, e.source, e.target, EXAMPLES[(i + 5) % len(EXAMPLES)].target)
                     for i, e in enumerate(EXAMPLES[s * 8:(s + 1) * 8], start=s * 8)] for s in range(STEPS)], path)
        return
    spec = rollout_spec_for(algorithm, kl=algorithm != "rank" and variant != "http")
    weights = load_policy(_model(family), checkpoint=init_dir).model.state_dict()
    worker = RolloutWorker(_model(family), str(init_dir), ROLLOUT, seed=3, max_source_len=16, spec=spec,
                           start_weights=weights)
    worker.set_weights(0, weights)
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in EXAMPLES]))
    torch.save([reward.score(worker.sample(EXAMPLES[i * 8:(i + 1) * 8])) for i in range(STEPS)], path)


def _learner(family: str, init: str, algorithm: str, strategy: str, rank: int, reference: str | None = None) -> Learner:
    """``algorithm``: a registered name, ``+lora`` for a LoRA policy (the same adapters on every rank), ``+http``
    for samples from policy servers (the learner holds and scores the reference: ``reference``, else ``init``)."""
    algorithm, _, variant = algorithm.partition("+")
    learner = Learner(_model(family, variant == "lora"), None, _rl(family, algorithm, strategy),
                      HTTP_ROLLOUT if variant == "http" else ROLLOUT, init_checkpoint=init, rank=rank, world_size=2,
                      total_steps=10, seed=0, max_source_len=16, max_target_len=16, reference_checkpoint=reference)
    # DDP through the sharded learner's passes (encoder states repeated, not a shared cross-attention cache,
    # which test_group_step.py compares with the repeated passes), so that the two differ in the sharding alone
    # (the two passes differ in round-off, which three policy-gradient steps grew to 2e-4 in the wide tiny T5's
    # loss).
    for module in (learner.module, *learner.objective.frozen_modules()):
        module.share_cross_attention = False
    return learner


def _rank(rank: int, rendezvous: str, out: str, family: str, init_dir: str, algorithm: str,
          plan: list[tuple[str, int]]) -> None:
    """Each (strategy, resume_at) of ``plan`` in turn, in this one process group: the learners' losses, gradient
    norms, bytes and an evaluation's table into ``<rank>.json``, their gathered weights into ``weights-*.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # what Learner.join leaves for accelerate
    out_dir = Path(out)
    batches = torch.load(out_dir / "batches.pt", weights_only=False)
    results: dict = {}
    for strategy, resume_at in plan:
        results[strategy] = _run(rank, out_dir / strategy, batches, family, init_dir, algorithm, strategy, resume_at)
    (out_dir / f"{rank}.json").write_text(json.dumps(results))
    # No teardown: freeing a DDP module under torch 2.13's gloo can deadlock (test_pg_rank_share.py's _rank).
    os._exit(0)


def _run(rank: int, out_dir: Path, batches: list, family: str, init_dir: str, algorithm: str, strategy: str,
         resume_at: int) -> dict:
    learners = {"run": _learner(family, init_dir, algorithm, strategy, rank)}
    results: dict = {"run": {"loss": [], "grad_norm": []}}
    # How often the first layer runs: twice per pass when its activations are recomputed for the backward.
    # (Counted in its forward itself: the recomputation calls it without the module's hooks.)
    calls = [0]
    layer = layer_units(learners["run"].policy.model)[0]
    forward = layer.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    layer.forward = counted
    # An evaluation first: 5 sources, so the ranks decode 3 and 2 (different passes, no collective inside),
    # and training after it must still match DDP's.
    results["run"]["eval"] = learners["run"].evaluate(EXAMPLES[:5], MetricConfig(), max_new_tokens=8)
    for step, batch in enumerate(batches):
        if step == resume_at:
            # As LearnerGroup.write_checkpoint: rank 1 hands its state to rank 0, then joins rank 0's gather
            # of the weights. A second learner on each rank starts from that checkpoint, its own state read
            # back, and trains beside the uninterrupted one from there.
            states: list = [None, None]
            dist.all_gather_object(states, learners["run"].training_state() if rank == 1 else None)
            root = out_dir / "checkpoints"
            if rank == 0:
                learners["run"].write_checkpoint(str(root), checkpoint_name(step=step), step, {}, [], [], states[1])
            else:
                learners["run"].weights()
            dist.barrier()
            path = root / checkpoint_name(step=step)
            learners["resumed"] = _learner(family, str(path), algorithm, strategy, rank, reference=init_dir)
            learners["resumed"].load_training_state_from(str(path))
            results["resumed"] = {"loss": [], "grad_norm": []}
        for name, learner in learners.items():
            metrics = learner.train_step(list(batch[rank::2]))
            results[name]["loss"].append(metrics["loss"])
            results[name]["grad_norm"].append(metrics.get("grad_norm", 0.0))
    results["run"]["layer_calls"] = calls[0]
    for name, learner in learners.items():
        results[name]["bytes"] = rank_bytes(learner.module, learner.optimizer)
        results[name]["frozen_bytes"] = sum(rank_bytes(m) for m in learner.objective.frozen_modules())
        weights = learner.weights() if strategy == "fsdp" or rank == 0 else {}
        if rank == 0:
            torch.save(weights, out_dir / f"weights-{name}.pt")
    return results


def _train(run_ranks, tmp: Path, family: str, init_dir: Path, algorithm: str) -> dict:
    """DDP's uninterrupted run, then FSDP's with a checkpoint after two steps (``run`` and ``resumed``), on the
    same two processes: per strategy and run, the ranks' results and the gathered weights."""
    plan = [("ddp", -1), ("fsdp", 2)]
    for strategy, _ in plan:
        (tmp / strategy).mkdir(parents=True)
    run_ranks(_rank, (str(tmp / "rendezvous"), str(tmp), family, str(init_dir), algorithm, plan), deadline_s=240)
    ranks = [json.loads((tmp / f"{r}.json").read_text()) for r in (0, 1)]
    return {strategy: {name: {"ranks": [ranks[r][strategy][name] for r in (0, 1)],
                              "weights": torch.load(tmp / strategy / f"weights-{name}.pt")}
                       for name in ranks[0][strategy]} for strategy, _ in plan}


@pytest.mark.slow
@pytest.mark.timeout(600)
# PPO's value head, rank RL's loss, LoRA, DPO, the learner's reference pass: family-independent. (`grpo+http`:
# GRPO with the learner scoring its sharded reference; `t5, grpo` takes the reference log-probs with the samples.)
@pytest.mark.parametrize("family_dir, algorithm", [("bart", "grpo+http"), ("bart", "ppo"), ("bart", "rank"),
                                                  ("bart", "grpo+lora"), ("bart", "dpo"), ("t5", "grpo")],
                         indirect=["family_dir"])
def test_fsdp_steps_as_ddp_with_half_the_bytes_per_rank_and_resumes_exactly(family_dir, algorithm, tmp_path,
                                                                            run_ranks):
    family, init_dir = family_dir
    _batches(family, init_dir, algorithm, tmp_path / "batches.pt")
    runs = _train(run_ranks, tmp_path, family, init_dir, algorithm)
    ddp, fsdp, resumed = runs["ddp"]["run"], runs["fsdp"]["run"], runs["fsdp"]["resumed"]
    assert fsdp["ranks"][0]["eval"] == ddp["ranks"][0]["eval"]  # the same greedy decodes, the same table
    # T5's run recomputes its layers' activations (rl.fsdp.activation_checkpointing): one more forward of a layer
    # per training pass; the evaluation's decoding steps are no-grad and run once either way.
    recomputed = fsdp["ranks"][0]["layer_calls"] - ddp["ranks"][0]["layer_calls"]
    assert recomputed > 0 if family == "t5" else recomputed == 0
    # The same losses on each rank's shard, step by step, and the same global gradient norm.
    for rank in (0, 1):
        assert fsdp["ranks"][rank]["loss"] == pytest.approx(ddp["ranks"][rank]["loss"], abs=1e-5)
        assert fsdp["ranks"][rank]["grad_norm"] == pytest.approx(ddp["ranks"][rank]["grad_norm"], rel=1e-4)
    # The whole weights gathered from the shards: DDP's keys (tied names included), values within 1e-5.
    assert set(fsdp["weights"]) == set(ddp["weights"])
    lora = algorithm.endswith("+lora")
    # Three steps changed the weights (LoRA: the adapters alone, whose B starts at zero), so equality below is
    # not equality of the starts.
    start = {} if lora else load_policy(_model(family), checkpoint=init_dir).model.state_dict()
    moved = max(float((ddp["weights"][k] - start.get(k, 0)).abs().max()) for k in ddp["weights"] if "lora_A" not in k)
    assert moved > 1e-3
    # Except the attention keys' biases (BART's k_proj.bias): a bias added to every key shifts all of a query's
    # logits alike, which the softmax ignores, so their gradient is zero in exact arithmetic and round-off in
    # floats, which AdamW's normalisation turns into steps of the learning rate's size, different for any two
    # orders of summation (two DDP bucket layouts as much as DDP and FSDP).
    exact = [k for k in ddp["weights"] if not k.endswith("k_proj.bias")]
    worst = max(float((fsdp["weights"][k] - ddp["weights"][k]).abs().max()) for k in exact)
    assert worst < 1e-5
    # Parameters plus AdamW's moments per rank: about half of DDP's whole copy (the value head stays whole).
    for rank in (0, 1):
        share = fsdp["ranks"][rank]["bytes"] / ddp["ranks"][rank]["bytes"]
        assert 0.45 < share < 0.6, share
    # A reference the learner holds (DPO's; GRPO's for policy servers' samples) is sharded as the policy is.
    holds_reference = algorithm in ("dpo", "grpo+http")
    assert bool(ddp["ranks"][0]["frozen_bytes"]) == holds_reference
    if holds_reference:
        for rank in (0, 1):
            share = fsdp["ranks"][rank]["frozen_bytes"] / ddp["ranks"][rank]["frozen_bytes"]
            assert 0.45 < share < 0.6, share
    # Checkpointed after two steps, new learners from that checkpoint take the third step as the run did.
    for rank in (0, 1):
        assert resumed["ranks"][rank]["loss"] == fsdp["ranks"][rank]["loss"][2:]
    assert all(torch.equal(resumed["weights"][k], fsdp["weights"][k]) for k in fsdp["weights"])
    checkpoint = read_checkpoint(tmp_path / "fsdp" / "checkpoints" / checkpoint_name(step=2))
    assert checkpoint is not None  # complete: a Hugging Face directory any loader reads
    assert load_policy(_model(family, lora), checkpoint=checkpoint.path).model.config.model_type == family


@pytest.mark.parametrize("change, message", [
    ({"rl": {"algorithm": "trpo"}}, "rl.algorithm=trpo has no sharded learner"),
    ({"run": {"mixed_precision": "fp16", "device": "cuda"}}, "run.mixed_precision=fp16"),
])
def test_what_fsdp_does_not_cover_is_refused_at_config_time_naming_the_key(change, message):
    base = {"rl": {"strategy": "fsdp", "learners": 2}}
    for section, values in change.items():
        base.setdefault(section, {}).update(values)
    with pytest.raises(ValueError, match="rl.strategy=fsdp: .*" + message.replace(".", r"\.")):
        Config.model_validate(base)
    Config.model_validate({**base, "rl": {**base["rl"], "strategy": "ddp"}})  # the same run under DDP is fine


@pytest.mark.parametrize("family", PRESET_FAMILIES)
def test_every_family_shards_by_its_encoder_and_decoder_layers(family, ids_tokenizer_dir):
    """One FSDP unit per layer, whatever the family calls its stacks (Pegasus and Marian declare no
    _no_split_modules; mBART also names its attention there)."""
    model = load_policy(ModelConfig(preset="small", family=family), ids_tokenizer_dir, seed=0).model
    units = layer_units(model)
    assert len(units) == 2 * PRESETS["small"]["layers"]
    assert all(type(u).__name__.endswith(("EncoderLayer", "DecoderLayer", "Block")) for u in units)
    assert len({id(p) for u in units for p in u.parameters()}) == sum(len(list(u.parameters())) for u in units)


@pytest.mark.parametrize("family_dir", ["bart"], indirect=True)
def test_one_sharded_rank_trains_and_its_snapshots_do_not_alias_the_live_weights(family_dir, tmp_path):
    """rl.strategy=fsdp with one learner (what one GPU with CPU offload, or bench/gpu.py, runs): a process group
    of one, formed by join. On the CPU FSDP's gathered tensors would be the parameters themselves, so a snapshot
    taken before a step must not move with it."""
    family, init_dir = family_dir
    _batches(family, init_dir, "grpo", tmp_path / "batches.pt")
    batches = torch.load(tmp_path / "batches.pt", weights_only=False)
    learner = Learner(_model(family), None, RLConfig(strategy="fsdp", batch_size=8, lr=1e-3, kl={"coef": 0.1}),
                      ROLLOUT, init_checkpoint=str(init_dir), rank=0, world_size=1, total_steps=10, seed=0,
                      max_source_len=16, max_target_len=16)
    learner.join(learner.rendezvous_address())
    try:
        before = learner.weights()
        learner.train_step(list(batches[0]))
        after = learner.weights()
        assert any(not torch.equal(before[k], after[k]) for k in after)
        summary, published = learner.publish_weights()
        assert summary["step"] == 1 and all(torch.equal(published[k], after[k]) for k in after)
    finally:
        learner.shutdown()


@pytest.mark.parametrize("family_dir", ["bart"], indirect=True)
def test_a_sharded_lora_learner_writes_any_published_version_for_the_policy_servers(family_dir, tmp_path):
    """rollout.source=http: rank 0 writes each published version as a checkpoint, its own adapters when it is at
    that version, else the published ones (peft's saved names mapped back to the model's)."""
    from rlt2t.common.lora import adapter_state_dict

    family, init_dir = family_dir
    _batches(family, init_dir, "grpo", tmp_path / "batches.pt")
    batches = torch.load(tmp_path / "batches.pt", weights_only=False)
    learner = Learner(_model(family, lora=True), None, RLConfig(strategy="fsdp", batch_size=8, lr=1e-3,
                      kl={"coef": 0.1}), ROLLOUT, init_checkpoint=str(init_dir), rank=0, world_size=1,
                      total_steps=10, seed=0, max_source_len=16, max_target_len=16)
    learner.join(learner.rendezvous_address())
    try:
        learner.train_step(list(batches[0]))
        first = learner.publish_weights()[1]
        learner.train_step(list(batches[1]))
        second = learner.weights()
        assert any(not torch.equal(first[k], second[k]) for k in first)
        root = tmp_path / "published"
        for version, expected in ((1, first), (2, second)):
            learner.write_published(str(root), version, {}, lambda: first)
            written = load_policy(_model(family, lora=True), checkpoint=root / checkpoint_name(step=version),
                                  trainable_adapters=True).model
            saved = adapter_state_dict(written)
            assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    finally:
        learner.shutdown()


@pytest.mark.parametrize("family_dir", ["t5"], indirect=True)  # BART's fp32 final_logits_bias would promote them
def test_under_bf16_the_shards_stay_fp32_compute_in_bf16_and_the_logits_come_out_fp32(family_dir, tmp_path):
    """run.mixed_precision=bf16 under FSDP (checked on the CPU, where FSDP casts as it does on a GPU): the
    parameters the optimizer steps stay fp32, the layers compute in bf16, and the root returns fp32 logits
    (what the losses' log-softmax reads, as under DDP's autocast)."""
    from rlt2t.common.config import FSDPConfig
    from rlt2t.learner import sharding
    from rlt2t.learner.group_step import GroupPolicy

    family, init_dir = family_dir
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = load_policy(_model(family), checkpoint=init_dir).model.eval()
        module = GroupPolicy(model)
        module.share_cross_attention = False
        sharding.shard(module, model, FSDPConfig(), device=torch.device("cpu"), mixed_precision="bf16")
        seen: list[torch.dtype] = []
        layer_units(model)[0].register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype))
        ids = torch.randint(10, 60, (2, 6))
        out = module(ids, torch.ones_like(ids), torch.randint(10, 60, (4, 5)), 2)
        out.logits.float().mean().backward()
        assert seen == [torch.bfloat16] and out.logits.dtype == torch.float32
        assert {p.dtype for p in module.parameters()} == {torch.float32}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters()
                   if p.requires_grad and p.grad is not None)
    finally:
        dist.destroy_process_group()
