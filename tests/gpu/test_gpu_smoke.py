"""GPU smoke test (`make gpu-smoke`): the learner's CUDA path through accelerate, bf16 and fp16.

Skipped without CUDA (so `make test` on a CPU machine passes); `make gpu-smoke` refuses to run there.
The sharded learner (rl.strategy=fsdp) and a sharded SFT stage (sft.strategy=fsdp) on one GPU. With two or more
GPUs it also forms two-rank nccl DDP and FSDP worlds through Ray, as training does.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.config import ModelConfig, RLConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.policy import load_policy
from rlt2t.common.types import ScoredPair
from rlt2t.learner.learner import Learner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pairs(n: int) -> list[ScoredPair]:
    g = torch.Generator().manual_seed(0)

    def text(k: int) -> str:
        return " ".join(str(int(x)) for x in torch.randint(0, 60, (k,), generator=g))

    return [ScoredPair(example_id=str(i), source=text(8), reference=(gold := text(4)), a=gold, b=text(5),
                       score_a=1.0, score_b=0.0, use_rank=True, policy_version=0) for i in range(n)]


@pytest.fixture
def init_dir(ids_tokenizer_dir, tmp_path):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(tmp_path / "init")
    policy.tokenizer.save_pretrained(tmp_path / "init")
    return tmp_path / "init"


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_learner_steps_on_cuda_with_mixed_precision(init_dir, precision):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per Accelerator singleton
    learner = Learner(ModelConfig(dropout=0.0), None,
                      RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0, learner_gpus=1),
                      init_checkpoint=str(init_dir), rank=0, world_size=1, total_steps=4, seed=0,
                      max_source_len=32, max_target_len=16, mixed_precision=precision)
    learner.join(("127.0.0.1", 0))
    assert learner.device.type == "cuda"
    assert learner.accelerator.mixed_precision == precision
    stats = learner.preflight()  # the largest batch first, as the job's learners do
    assert stats["peak_memory_gib"] > 0 and not learner.optimizer.state
    before = {k: v.clone() for k, v in learner.weights().items()}
    for _ in range(3):
        metrics = learner.train_step(_pairs(8))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    after = learner.weights()
    assert any(not torch.equal(before[k], after[k]) for k in after), "no parameter moved"
    assert all(v.device.type == "cpu" for v in after.values())  # published weights are CPU tensors
    state = learner.training_state()
    assert ("scaler" in state) == (precision == "fp16")


@pytest.mark.parametrize("algorithm,source,sft_coef,precision",
                         [("nlpo", "ray", 0.0, "no"), ("grpo", "http", 0.0, "no"), ("grpo", "http", 0.5, "bf16"),
                          ("ppo", "http", 0.5, "fp16")])
def test_policy_gradient_learner_steps_on_cuda_with_its_frozen_models(init_dir, algorithm, source, sft_coef,
                                                                       precision):
    """A policy-gradient learner on the GPU with the models it runs besides the trained one: NLPO's masking
    policy, and the reference it scores samples from policy servers with (they send no reference log-probs).
    Both must sit on the learner's device: preflight, then steps. With rl.pg.sft_coef under mixed precision the
    gold rows ride the same autocast pass as the samples (and PPO's value head on the widened rows)."""
    import copy

    from accelerate.state import AcceleratorState

    from rlt2t.actors.reward import RewardWorker
    from rlt2t.actors.rollout import RolloutWorker
    from rlt2t.common.config import RewardConfig
    from rlt2t.common.metrics import DocumentFrequency

    AcceleratorState._reset_state(reset_partial_state=True)
    rl = RLConfig(algorithm=algorithm, lr=1e-3, warmup_ratio=0.0, batch_size=8, learner_gpus=1,
                  pg={"sft_coef": sft_coef})
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8, source=source)
    model = ModelConfig(preset="tiny", family="bart", dropout=0.0)
    learner = Learner(model, None, rl, rollout, init_checkpoint=str(init_dir), rank=0,
                      world_size=1, total_steps=4, seed=0, max_source_len=32, max_target_len=16,
                      mixed_precision=precision)
    learner.join(("127.0.0.1", 0))
    assert learner.device.type == "cuda" and learner.accelerator.mixed_precision == precision
    frozen = learner.objective.frozen_modules()
    assert len(frozen) == 1 and all(p.device.type == "cuda" for m in frozen for p in m.parameters())
    stats = learner.preflight()
    assert stats["peak_memory_gib"] > 0 and not learner.optimizer.state
    # Samples from a CPU rollout worker (without reference log-probs for the http case, as a policy server)
    spec = rollout_spec_for(algorithm, kl=rl.uses_kl and source == "ray", mask_top_p=rl.pg.nlpo_top_p)
    weights = learner.weights()
    worker = RolloutWorker(model, str(init_dir), RolloutConfig(num_samples=3, top_k=0,
                           max_new_tokens=8), seed=0, max_source_len=32, spec=spec,
                           start_weights=weights if spec.reference else None)
    worker.set_weights(0, weights)
    if algorithm == "nlpo":
        worker.mask_model = copy.deepcopy(worker.policy.model)
        worker.mask_model.load_state_dict(learner.objective.mask_model.state_dict())
    examples = [Example(id=str(i), source=f"{11 + i} 12 {13 + i}", target=f"14 {15 + i}") for i in range(8)]
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in examples]))
    groups = reward.score(worker.sample(examples))
    before = {k: v.clone() for k, v in learner.weights().items()}
    for _ in range(2):
        metrics = learner.train_step(groups)
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        assert ("sft_loss" in metrics) == bool(sft_coef)
        if sft_coef:  # CE of the gold ids of an untrained tiny model: about log(vocab), not 0
            assert metrics["sft_loss"] > 1.0, metrics
    assert any(not torch.equal(before[k], v) for k, v in learner.weights().items()), "no parameter moved"


def test_rollout_worker_samples_on_cuda(ids_tokenizer_dir, init_dir):
    from rlt2t.actors.rollout import RolloutWorker

    worker = RolloutWorker(ModelConfig(dropout=0.0), str(ids_tokenizer_dir), RolloutConfig(num_samples=4,
                           max_new_tokens=8), seed=0, max_source_len=32, device="cuda")
    assert {p.device.type for p in worker.policy.model.parameters()} == {"cuda"}
    examples = [Example(id=str(i), source="11 12 13", target="14 15") for i in range(3)]
    first, again = worker.sample(examples), worker.sample(examples)
    assert [s.candidates for s in first] == [s.candidates for s in again]  # seeded per (seed, version, id)


def test_ct2_rollout_worker_samples_on_its_gpu(ids_tokenizer_dir, init_dir):
    from rlt2t.actors.rollout import RolloutWorker

    worker = RolloutWorker(ModelConfig(dropout=0.0), str(ids_tokenizer_dir), RolloutConfig(
        num_samples=4, max_new_tokens=8, backend="ct2", ct2_compute_type="int8_float16", top_k=0),
        seed=0, max_source_len=32, device="cuda", spec=rollout_spec_for("grpo", kl=False))
    examples = [Example(id=str(i), source="11 12 13", target="14 15") for i in range(3)]
    groups = worker.sample(examples)
    assert worker._ct2 is not None and worker._ct2._translator_args["device"] == "cuda"
    assert all(len(g.token_ids) == 4 for g in groups)


@contextlib.contextmanager
def _two_ray_ranks(init_dir, strategy: str):
    """Two bf16 rank-RL learner actors on two GPUs, joined into one nccl world through Ray, as training does."""
    import ray

    ray.init(num_gpus=2, include_dashboard=False, configure_logging=False)
    try:
        cfg = RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0, batch_size=16, learners=2, learner_gpus=1,
                       strategy=strategy)
        actor = ray.remote(Learner).options(num_cpus=1, num_gpus=1)
        ranks = [actor.remote(ModelConfig(dropout=0.0), None, cfg, init_checkpoint=str(init_dir), rank=i,
                              world_size=2, total_steps=4, seed=0, max_source_len=32, max_target_len=16,
                              mixed_precision="bf16") for i in range(2)]
        rendezvous = ranks[0].rendezvous_address.remote()
        ray.get([r.join.remote(rendezvous) for r in ranks])
        yield ranks
    finally:
        ray.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_nccl_ddp_keeps_ranks_identical(init_dir):
    import ray

    with _two_ray_ranks(init_dir, "ddp") as ranks:
        pairs = _pairs(16)
        for _ in range(2):
            ray.get([r.train_step.remote(pairs[i::2]) for i, r in enumerate(ranks)])
        w0, w1 = ray.get([r.weights.remote() for r in ranks])
        assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_sharded_learner_steps_on_one_gpu_in_bf16(init_dir):
    """rl.strategy=fsdp on one GPU (a one-rank nccl group): bf16 parameters with fp32 reductions, activation
    checkpointing, the preflight, three steps, an evaluation on the gathered weights, bf16 publishing."""
    from accelerate.state import AcceleratorState

    from rlt2t.common.config import MetricConfig

    AcceleratorState._reset_state(reset_partial_state=True)
    learner = Learner(ModelConfig(dropout=0.0), None,
                      RLConfig(algorithm="rank", lr=1e-3, warmup_ratio=0.0, learner_gpus=1, strategy="fsdp",
                               fsdp={"activation_checkpointing": True}),
                      init_checkpoint=str(init_dir), rank=0, world_size=1, total_steps=4, seed=0,
                      max_source_len=32, max_target_len=16, mixed_precision="bf16")
    learner.join(learner.rendezvous_address())
    assert learner.device.type == "cuda"
    assert learner.preflight()["peak_memory_gib"] > 0
    before = learner.weights()
    for _ in range(3):
        metrics = learner.train_step(_pairs(8))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    after = learner.weights()
    assert after.keys() == before.keys() and all(v.dtype == torch.float32 for v in after.values())  # fp32 shards
    assert any(not torch.equal(before[k], after[k]) for k in after), "no parameter moved"
    summary, published = learner.publish_weights()
    assert summary["step"] == 3 and {v.dtype for v in published.values() if v.is_floating_point()} == {torch.bfloat16}
    examples = [Example(id=str(i), source=" ".join(str(10 + i + j) for j in range(5)), target="11 12")
                for i in range(3)]
    table, outputs = learner.evaluate(examples, MetricConfig(), max_new_tokens=8)
    assert "cider_d" in table and len(outputs) == 3
    learner.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_nccl_fsdp_gathers_the_whole_policy_on_rank_zero(init_dir):
    import ray

    with _two_ray_ranks(init_dir, "fsdp") as ranks:
        pairs = _pairs(16)
        for _ in range(2):
            metrics = ray.get([r.train_step.remote(pairs[i::2]) for i, r in enumerate(ranks)])
            assert metrics[0]["loss"] == metrics[1]["loss"]  # averaged over the ranks
        w0, w1 = ray.get([r.weights.remote() for r in ranks])  # a collective: both ranks call it
        start = load_policy(ModelConfig(), checkpoint=init_dir).model.state_dict()
        assert w1 == {} and w0.keys() == start.keys()
        assert any(not torch.equal(w0[k], start[k]) for k in start), "no parameter moved"


def test_sft_stage_sharded_on_one_gpu_in_bf16(init_dir, tmp_path, monkeypatch):
    """sft.strategy=fsdp on one GPU (a one-rank nccl group, as one of rlt2t.stage_group's ranks forms it): bf16
    parameters with fp32 reductions, activation checkpointing, the validation monitor on the gathered weights, and
    a checkpoint of the whole fp32 model."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    from rlt2t.common.checkpoint import read_checkpoint
    from rlt2t.common.collate import encode_examples
    from rlt2t.common.config import FSDPConfig, MetricConfig, RunConfig, SFTConfig
    from rlt2t.common.policy import Policy
    from rlt2t.learner.evaluate import monitor_score
    from rlt2t.learner.learner import free_address
    from rlt2t.learner.stages import run_sft

    AcceleratorState._reset_state(reset_partial_state=True)
    host, port = free_address()
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR=host,
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl", init_method=f"tcp://{host}:{port}", rank=0, world_size=1)
    try:
        policy = load_policy(ModelConfig(dropout=0.0), checkpoint=init_dir)
        examples = [Example(id=str(i), source=" ".join(str(10 + (i + j) % 50) for j in range(6)),
                            target=" ".join(str(10 + (i * 3 + j) % 50) for j in range(3))) for i in range(12)]
        enc = encode_examples(policy.tokenizer, [e.source for e in examples], [e.target for e in examples], 32, 16)

        def evaluate(model):
            return monitor_score(Policy(model, policy.tokenizer, policy.origin), examples[:4], MetricConfig(),
                                 max_source_len=32, max_new_tokens=8, by="loss")

        cfg = SFTConfig(epochs=1, batch_size=4, lr=1e-3, warmup_ratio=0.0, patience=0, strategy="fsdp")
        run = RunConfig(dir=str(tmp_path / "run"), device="cuda", mixed_precision="bf16", progress=False, log_every=1)
        result = run_sft(policy, enc.sources, enc.targets, cfg, run, tmp_path / "run" / "sft", evaluate=evaluate,
                         fsdp=FSDPConfig(activation_checkpointing=True))
        assert result.steps == 3 and torch.isfinite(torch.tensor(result.last_metrics["loss"]))
        assert result.last_metrics["rank_state_bytes"] > 0
        assert read_checkpoint(result.checkpoint).meta["metrics"]["valid_loss"] > 0
        saved = load_policy(ModelConfig(), checkpoint=result.checkpoint).model.state_dict()
        start = load_policy(ModelConfig(), checkpoint=init_dir).model.state_dict()
        assert all(v.dtype == torch.float32 for v in saved.values())  # the fp32 shards, gathered
        assert any(not torch.equal(saved[k], start[k]) for k in start), "no parameter moved"
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_sft_stage_on_two_sharded_gpu_ranks_through_ray(tmp_path):
    """The SFT job (what `rlt2t sft` runs) with sft.strategy=fsdp on two Ray ranks of one GPU each (nccl, the
    objects over a gloo group): the stage's checkpoint holds the whole fp32 model, and the log rank 0's metrics."""
    import json
    from pathlib import Path

    import ray

    from rlt2t.common.checkpoint import read_checkpoint
    from rlt2t.common.config import load_config
    from rlt2t.jobs import build_tokenizer_job, make_synthetic_data, sft_job

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    cfg = load_config([tiny], [f"run.dir={tmp_path / 'run'}", "run.device=cuda", "run.mixed_precision=bf16",
                               "sft.strategy=fsdp", "sft.max_steps=3", "sft.epochs=1", "sft.patience=0",
                               "rl.learners=2", "rl.learner_gpus=1", "rl.learner_cpus=1", "run.log_every=1"])
    make_synthetic_data(cfg)
    build_tokenizer_job(cfg)
    try:
        result = sft_job(cfg)
    finally:
        ray.shutdown()
    assert result.steps == 3 and read_checkpoint(result.checkpoint).meta["ranks"] == 2
    saved = load_policy(cfg.model, cfg.tokenizer_dir, checkpoint=result.checkpoint).model.state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values())
    rows = [json.loads(x) for x in (tmp_path / "run" / "logs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind", "train") == "train"] == [1, 2, 3]
