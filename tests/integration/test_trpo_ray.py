"""TRPO as a Ray job (`rlt2t train rl.algorithm=trpo`): a resume from a run cut short bitwise identical to an
uninterrupted run (the value head, its optimiser and the KL controller included), and two DDP ranks that take the
same trust-region step as each other and as one learner on the whole batch. The run is cut short in this process
(`stop_after_steps`, after the step past its last checkpoint): what a real SIGKILL leaves behind is the same files,
and test_pg_ray kills a run's driver and Ray for real, test_rl_ray a learner rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.checkpoint import load_training_state
from rlt2t.common.config import ModelConfig, RewardConfig, RLConfig, RolloutConfig, load_config
from rlt2t.common.data import load_examples
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.policy import load_policy
from rlt2t.jobs import best_or_latest, rl_job
from rlt2t.learner.learner import Learner

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
ALGORITHM = "trpo"
STEPS = 8  # 2 epochs x 32 sources / 8 per step
SETTINGS = [f"rl.algorithm={ALGORITHM}", "rl.epochs=2", "rl.train_subset=32", "rl.batch_size=8", "rl.chunk_size=8",
            "rl.refresh_every_steps=1", "rl.kl.coef=0.05", "rl.kl.target=1.0", "rl.kl.horizon=100",
            "rollout.num_samples=3", "rollout.top_k=0", "run.log_every=1", "rl.save_every_steps=2",
            "rl.trpo.max_kl=0.02"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_policy(ModelConfig(), checkpoint=path).model.state_dict().items()}


def _learner_state(path: Path) -> dict:
    return load_training_state(path)["learners"][0]["objective"]


def test_resume_of_a_run_cut_short_is_bitwise_identical(ray_session, copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "reference")
    result = rl_job(load_config([TINY], [f"run.dir={run}", *SETTINGS]))
    assert result.steps == STEPS
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    assert len(train) == STEPS
    assert all(r["trpo_kl"] <= 0.02 and "value_loss" in r and "explained_variance" in r for r in train)
    assert sum(r["trpo_rejected"] == 0 for r in train) >= STEPS // 2  # most steps are taken
    weights, state = _weights(result.checkpoint), _learner_state(result.checkpoint)
    assert state["value_optimizer"]["state"]

    killed = copy_prepared(tmp_path / "killed")
    cut = rl_job(load_config([TINY], [f"run.dir={killed}", *SETTINGS]), stop_after_steps=3)
    assert cut.steps == 3  # its last checkpoint is step 2's: the resumed run trains step 3 again
    resumed = rl_job(load_config([TINY], [f"run.dir={killed}", *SETTINGS]), resume=True)
    assert resumed.steps == STEPS
    got = _weights(resumed.checkpoint)
    assert all(torch.equal(weights[k], got[k]) for k in weights), "resumed run differs from uninterrupted"
    got_state = _learner_state(resumed.checkpoint)
    assert got_state["kl"] == state["kl"]
    assert all(torch.equal(state["value_head"][k], got_state["value_head"][k]) for k in state["value_head"])
    moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in state["value_optimizer"]["state"].values()]
    got_moments = [(s["exp_avg"], s["exp_avg_sq"]) for s in got_state["value_optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for pair, got_pair in zip(moments, got_moments, strict=True)
               for a, b in zip(pair, got_pair, strict=True))


def test_two_ddp_ranks_take_one_step_the_whole_batch_would(ray_session, prepared_run):
    cfg = load_config([TINY], [f"run.dir={prepared_run}", *SETTINGS])
    sft = best_or_latest(prepared_run / "sft" / "checkpoints")
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=12)
    rl = RLConfig(algorithm=ALGORITHM, batch_size=8, learners=2, kl={"coef": 0.05}, trpo={"max_kl": 0.02})
    examples = load_examples(prepared_run / "data" / "train.jsonl")[:16]
    start = load_policy(cfg.model, checkpoint=sft).model.state_dict()
    worker = RolloutWorker(cfg.model, str(cfg.tokenizer_dir), rollout, seed=0, max_source_len=32,
                           spec=rollout_spec_for(ALGORITHM, kl=True), start_weights=start)
    worker.set_weights(0, start)
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in examples]))
    batches = [reward.score(worker.sample(examples[i : i + 8])) for i in (0, 8)]
    kwargs = dict(init_checkpoint=str(sft), total_steps=10, seed=0, max_source_len=32, max_target_len=16)
    actor = ray.remote(Learner).options(num_cpus=1)
    ranks = [actor.remote(cfg.model, str(cfg.tokenizer_dir), rl, rollout, rank=i, world_size=2, **kwargs)
             for i in range(2)]
    single = Learner(cfg.model, str(cfg.tokenizer_dir), rl.model_copy(update={"learners": 1}), rollout, rank=0,
                     world_size=1, **kwargs)
    try:
        rendezvous = ranks[0].rendezvous_address.remote()
        ray.get([r.join.remote(rendezvous) for r in ranks])
        for groups in batches:  # both steps from the same samples: the second starts from the first's weights
            metrics = ray.get([r.train_step.remote(groups[i::2]) for i, r in enumerate(ranks)])
            assert metrics[0] == metrics[1], "logged scalars must be reduced across ranks"
            assert metrics[0]["trpo_rejected"] == 0 and metrics[0]["trpo_kl"] <= 0.02
            whole = single.train_step(groups)
            assert whole["trpo_step_fraction"] == metrics[0]["trpo_step_fraction"]
            assert whole["trpo_kl"] == pytest.approx(metrics[0]["trpo_kl"], rel=1e-3)
        w0, w1 = ray.get([r.weights.remote() for r in ranks])
        assert all(torch.equal(w0[k], w1[k]) for k in w0), "DDP ranks diverged"
        s0, s1 = ray.get([r.training_state.remote() for r in ranks])
        assert s0["objective"]["kl"] == s1["objective"]["kl"]
        for key in s0["objective"]["value_head"]:
            assert torch.equal(s0["objective"]["value_head"][key], s1["objective"]["value_head"][key])
        # the ranks' sums of gradients and Fisher-vector products are the whole batch's, up to rounding
        ws = single.weights()
        assert max((w0[k] - ws[k]).abs().max().item() for k in w0) < 1e-4
        assert max((w0[k] - start[k]).abs().max().item() for k in w0) > 1e-3, "the learners did not train"
    finally:
        for r in ranks:
            ray.kill(r)
