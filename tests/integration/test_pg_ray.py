"""The policy-gradient algorithms on a real (embedded) Ray (PPO: value head, GAE, adaptive KL; GRPO on sharded
learners; NLPO's masking policy): bitwise resume after a real kill of the driver and its Ray (PPO on LoRA adapters:
value head and KL controller included) and of a run cut short (GRPO's per-rank optimizer shards), a killed rollout
worker re-dispatched with nothing lost, and DDP ranks that stay identical (PPO with the likelihood term). RLOO
differs from GRPO in its advantages alone (tests/unit/learner/test_pg_losses.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.algorithms import rollout_spec_for
from rlt2t.common.checkpoint import latest_complete_checkpoint, load_training_state, read_checkpoint
from rlt2t.common.config import ModelConfig, RewardConfig, RLConfig, RolloutConfig, load_config
from rlt2t.common.data import load_examples
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.policy import load_policy
from rlt2t.jobs import best_or_latest, rl_job
from rlt2t.learner.learner import Learner

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
STEPS = 12  # 2 epochs x 48 sources / 8 per step
SETTINGS = ["rl.epochs=2", "rl.train_subset=48", "rl.batch_size=8", "rl.chunk_size=8", "rl.refresh_every_steps=1",
            "rl.kl.coef=0.05", "rl.kl.target=1.0", "rl.kl.horizon=100", "rollout.num_samples=3", "rollout.top_k=0",
            "run.log_every=1", "rl.save_every_steps=4"]


LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "model.lora.dropout=0"]
# The uninterrupted runs: PPO (value head, KL controller) on LoRA adapters, and GRPO on two sharded learner ranks
# (rl.strategy=fsdp: checkpoints of gathered weights and per-rank optimizer shards, resumed by ranks that each
# read their own). Full-weight resume under DDP: rank RL in test_rl_ray.py, TRPO in test_trpo_ray.py.
VARIANTS = {"ppo-lora": ("ppo", LORA), "grpo-fsdp": ("grpo", ["rl.strategy=fsdp", "rl.learners=2"])}


def _config(run: Path, algorithm: str, *extra: str):
    return load_config([TINY], [f"run.dir={run}", f"rl.algorithm={algorithm}", *SETTINGS, *extra])



def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_policy(ModelConfig(), checkpoint=path).model.state_dict().items()}


def _learner_state(path: Path) -> dict:
    return load_training_state(path)["learners"][0]["objective"]


@pytest.fixture(scope="module")
def references(ray_session, prepared_run, copy_prepared, tmp_path_factory):
    """Uninterrupted runs: the final weights and learner state every other run must reproduce exactly."""
    out = {}
    for variant, (algorithm, extra) in VARIANTS.items():
        run = copy_prepared(tmp_path_factory.mktemp(f"ref-{variant}") / "run")
        result = rl_job(_config(run, algorithm, *extra))
        assert result.steps == STEPS and result.items_used == 2 * 48 and result.redispatched == 0
        rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if r.get("kind", "train") == "train"]
        assert len(train) == STEPS
        for key in ("reward_mean", "reward_std", "kl_k1", "kl_k3", "kl_coef", "clip_fraction", "approx_kl", "entropy",
                    "advantage_mean", "ratio_mean", "sampler_ratio_max_dev", "staleness_mean", "staleness_max"):
            assert all(key in r for r in train), key
        # refresh_every_steps=1: every batch sampled by the weights one step behind the learner (after the first)
        assert {r["staleness_max"] for r in train[2:]} == {1}
        if algorithm == "ppo":
            assert all("value_loss" in r and "explained_variance" in r for r in train)
        assert len({r["kl_coef"] for r in train}) > 1  # the adaptive controller moves β
        out[variant] = (_weights(result.checkpoint), _learner_state(result.checkpoint))
        # The checkpoint keeps the published weights a run resumed from it samples with first (one step stale:
        # STEPS - 1), not one copy per learner step of the epoch.
        assert sorted(int(v) for v in load_training_state(result.checkpoint)["published"]) == [STEPS - 1]
        if extra == LORA:  # the checkpoints hold adapters; the frozen base is the SFT model, unchanged
            assert (result.checkpoint / "adapter_config.json").is_file()
            sft = _weights(best_or_latest(prepared_run / "sft" / "checkpoints"))
            tuned = out[variant][0]
            assert any(not torch.equal(sft[k], tuned[k]) for k in sft), "the adapters did not train"
    return out


def _same_end(references, variant: str, result) -> None:
    """The resumed run ``result`` ended where the uninterrupted run of ``variant`` did, bit for bit."""
    algorithm, _ = VARIANTS[variant]
    assert result.steps == STEPS
    weights, state = references[variant]
    resumed = _weights(result.checkpoint)
    assert all(torch.equal(weights[k], resumed[k]) for k in weights), "resumed run differs from uninterrupted"
    resumed_state = _learner_state(result.checkpoint)
    assert resumed_state["kl"] == state["kl"]  # the KL controller's coefficient, exactly
    if algorithm == "ppo":
        assert all(torch.equal(state["value_head"][k], resumed_state["value_head"][k]) for k in state["value_head"])


def test_resume_after_a_real_kill_is_bitwise_identical(references, copy_prepared, kill_training, tmp_path):
    """The driver and its embedded Ray SIGKILLed mid-run: what the kill leaves behind resumes to the end of the
    uninterrupted run. One algorithm: checkpoints are written by the learner group and the scheduler that every
    algorithm shares (DPO's offline loop included)."""
    algorithm, extra = VARIANTS["ppo-lora"]
    run = copy_prepared(tmp_path / "killed")
    killed_at = kill_training(run, f"rl.algorithm={algorithm}", *SETTINGS, *extra)
    assert 4 <= killed_at < STEPS
    _same_end(references, "ppo-lora", rl_job(_config(run, algorithm, *extra), resume=True))


def test_sharded_ranks_resume_a_run_cut_short_bitwise(references, copy_prepared, tmp_path):
    """GRPO on two FSDP ranks, stopped after the step past its step-4 checkpoint (in this process: a real kill
    leaves the same files, test above), resumed by ranks that each read their own optimizer shard."""
    algorithm, extra = VARIANTS["grpo-fsdp"]
    run = copy_prepared(tmp_path / "cut")
    cut = rl_job(_config(run, algorithm, *extra), stop_after_steps=5)
    assert cut.steps == 5 and read_checkpoint(latest_complete_checkpoint(run / "rl" / "checkpoints")).step == 4
    _same_end(references, "grpo-fsdp", rl_job(_config(run, algorithm, *extra), resume=True))


def test_a_killed_rollout_worker_is_redispatched_and_nothing_is_lost(references, copy_prepared, tmp_path):
    run = copy_prepared(tmp_path / "faulty")
    box: dict = {}

    def target():
        try:
            box["result"] = rl_job(_config(run, "ppo", *LORA))
        except BaseException as e:  # noqa: BLE001 - inspected below
            box["error"] = e

    job = threading.Thread(target=target)
    job.start()
    killed = None
    deadline = time.time() + 600
    while killed is None and time.time() < deadline and job.is_alive():
        for proc in psutil.Process().children(recursive=True):
            try:
                if any(part.startswith("ray::RolloutWorker.sample_version") for part in proc.cmdline()):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = proc.pid
                    break
            except psutil.Error:
                continue
        time.sleep(0.05)
    job.join(timeout=600)
    assert "error" not in box, box.get("error")
    assert killed is not None, "never found a rollout worker to kill"
    result = box["result"]
    assert result.redispatched >= 1 and result.items_used == 2 * 48 and result.steps == STEPS
    weights, _ = references["ppo-lora"]  # re-dispatch is the driver's: any algorithm shows it
    got = _weights(result.checkpoint)
    assert all(torch.equal(weights[k], got[k]) for k in weights), "a re-dispatched chunk changed the result"


# One algorithm: the ranks' wiring on Ray is the same for every policy gradient. PPO keeps the most state in step
# (the value head, the KL controller) and the likelihood term adds a loss on the gold targets; that each
# algorithm's DDP step equals one learner's on the whole batch is tests/unit/learner/test_pg_rank_share.py's
# and test_fsdp.py's.
@pytest.mark.parametrize(("algorithm", "pg"), [("ppo", {"sft_coef": 0.5})], ids=["ppo-sft"])
def test_two_ddp_ranks_stay_identical(ray_session, prepared_run, algorithm, pg):
    cfg = _config(prepared_run, algorithm)
    sft = best_or_latest(prepared_run / "sft" / "checkpoints")
    rollout = RolloutConfig(num_samples=3, top_k=0, max_new_tokens=12)
    rl = RLConfig(algorithm=algorithm, batch_size=8, learners=2, lr=1e-3, kl={"coef": 0.05}, pg=pg)
    examples = load_examples(prepared_run / "data" / "train.jsonl")[:24]
    worker = RolloutWorker(cfg.model, str(cfg.tokenizer_dir), rollout, seed=0, max_source_len=32,
                           spec=rollout_spec_for(algorithm, kl=True),
                           start_weights=load_policy(cfg.model, checkpoint=sft).model.state_dict())
    worker.set_weights(0, load_policy(cfg.model, checkpoint=sft).model.state_dict())
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in examples]))
    kwargs = dict(init_checkpoint=str(sft), total_steps=10, seed=0, max_source_len=32, max_target_len=16)
    actor = ray.remote(Learner).options(num_cpus=1)
    ranks = [actor.remote(cfg.model, str(cfg.tokenizer_dir), rl, rollout, rank=i, world_size=2, **kwargs)
             for i in range(2)]
    try:
        rendezvous = ranks[0].rendezvous_address.remote()
        ray.get([r.join.remote(rendezvous) for r in ranks])
        for start in range(0, 24, 8):
            groups = reward.score(worker.sample(examples[start : start + 8]))
            metrics = ray.get([r.train_step.remote(groups[i::2]) for i, r in enumerate(ranks)])
            assert metrics[0] == metrics[1], "logged scalars must be reduced across ranks"
            # the likelihood term on the gold targets: a cross-entropy, logged only when it is on
            assert ("sft_loss" in metrics[0]) == bool(pg) and metrics[0].get("sft_loss", 1.0) > 0
        w0, w1 = ray.get([r.weights.remote() for r in ranks])
        assert all(torch.equal(w0[k], w1[k]) for k in w0), "DDP ranks diverged"
        s0, s1 = ray.get([r.training_state.remote() for r in ranks])
        assert s0["objective"]["kl"] == s1["objective"]["kl"]
        if algorithm == "ppo":
            assert all(torch.equal(s0["objective"]["value_head"][k], s1["objective"]["value_head"][k])
                       for k in s0["objective"]["value_head"])
        start_weights = load_policy(cfg.model, checkpoint=sft).model.state_dict()
        assert max((w0[k] - start_weights[k]).abs().max().item() for k in w0) > 1e-4, "the learners did not train"
    finally:
        for r in ranks:
            ray.kill(r)


def test_a_policy_gradient_trains_through_live_policy_and_reward_servers(ray_session, copy_prepared, tmp_path,
                                                                         live_server):
    """rollout.source=http + reward.source=http with SCST (groups, sample log-probs from the server, a greedy
    baseline, reference log-probs computed by the learner): every source is used once and the sampler's
    log-probs agree with the learner's when the server serves the version the learner is at."""
    from rlt2t.services import policy_app, reward_app

    run = copy_prepared(tmp_path / "http")
    socks = [live_server.reserve(), live_server.reserve()]  # held until the servers serve on them
    policy_url, reward_url = (live_server.url_of(s) for s in socks)
    cfg = _config(run, "scst", "rl.epochs=1", "rl.train_subset=16", "rollout.source=http",
                  f"rollout.urls=[\"{policy_url}\"]", "reward.source=http", f"reward.url={reward_url}",
                  "serve.reload_interval_s=0.2", "rollout.timeout_s=120", "rl.refresh_every_steps=0")
    box: dict = {}

    def target():
        try:
            box["result"] = rl_job(cfg)
        except BaseException as e:  # noqa: BLE001 - inspected below
            box["error"] = e

    job = threading.Thread(target=target)
    job.start()
    published = run / "rl" / "published"
    deadline = time.time() + 300
    while latest_complete_checkpoint(published) is None and job.is_alive() and time.time() < deadline:
        time.sleep(0.1)
    assert latest_complete_checkpoint(published) is not None, box
    servers = [live_server(policy_app.create_app(cfg, checkpoint_dir=published), socks[0]),
               live_server(reward_app.create_app(cfg, document_frequency=run / "rl" / "document_frequency.json"),
                           socks[1])]
    with servers[0], servers[1]:
        job.join(timeout=600)
    assert "error" not in box, box.get("error")
    assert box["result"].items_used == 16 and box["result"].steps == 2
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    # Step 0 trains on version 0, which is what the server served: its ratio to the learner is 1.
    first = next(r for r in train if r["step"] == 1)
    assert first["staleness_max"] == 0 and first["sampler_ratio_max_dev"] < 1e-3, first
    assert all("greedy_reward" in r and r["kl_coef"] > 0 for r in train)


def test_nlpo_ships_its_masking_policy_to_the_rollout_workers(ray_session, copy_prepared, tmp_path):
    """NLPO's chunks carry a second version, the masking policy's, which the rollout workers load from the object
    store beside the policy's, and the learner steps are sent for the groups they train on: the job runs
    through, with the masking policy refreshed every 2 steps."""
    run = copy_prepared(tmp_path / "nlpo")
    result = rl_job(_config(run, "nlpo", "rl.epochs=1", "rl.train_subset=32", "rl.pg.nlpo_mask_refresh_steps=2",
                            "rl.pg.nlpo_top_p=0.9"))
    assert result.steps == 4 and result.items_used == 32
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    # the sampler masked as the learner does: on-policy samples agree with the learner's masked log-probs
    assert any(r["staleness_max"] == 0 for r in train), [r["staleness_max"] for r in train]
    assert all(r["sampler_ratio_max_dev"] < 1e-3 for r in train if r["staleness_max"] == 0)
    # the learner masks with the weights each step is sent (those its groups were sampled under): no copy of
    # its own to refresh or checkpoint
    assert "mask_model" not in _learner_state(result.checkpoint)


def test_several_references_reach_the_rewards_and_the_document_frequencies(ray_session, copy_prepared, tmp_path):
    """Rows with `references`: the job's CIDEr-D frequencies count every reference, and its rewards score the
    same samples against all of them (a second reference the samples do not say lowers CIDEr-D, a mean over
    the references)."""
    rewards = {}
    for name in ("target", "references"):
        run = copy_prepared(tmp_path / name)
        train = run / "data" / "train.jsonl"
        rows = [json.loads(x) for x in train.read_text().splitlines()]
        if name == "references":
            rows = [{**r, "references": [r["target"], "57 58 59 57 58 59"]} for r in rows]
            train.write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = rl_job(_config(run, "grpo", "rl.epochs=1", "rl.train_subset=8", "reward.bleu_weight=0"))
        assert result.steps == 1
        [step] = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()
                  if json.loads(x).get("kind", "train") == "train"]
        rewards[name] = step["reward_mean"]
    df = DocumentFrequency.from_json((run / "rl" / "document_frequency.json").read_text())
    assert df.counts[("57", "58", "59")] == df.num_ref_sets == 8  # in the references of each source trained on
    assert 0 < rewards["references"] < 0.75 * rewards["target"], rewards


def logged_brevity(sources, candidates, references, *, log):
    """A reward that reads no references (minus each candidate's length), writing down every call's rows."""
    scores = [-float(len(c.split())) for c in candidates]
    with open(log, "a") as f:
        f.writelines(json.dumps({"source": s, "references": r, "score": x}) + "\n"
                     for s, r, x in zip(sources, references, scores, strict=True))
    return scores


def test_sources_without_targets_train_with_a_reward_that_reads_no_references(ray_session, copy_prepared, tmp_path):
    """Training and validation rows with a source alone: GRPO trains on them through `rlt2t.train` with a Python
    reward, which gets empty reference lists; `metric.monitor=reward` picks the checkpoint, on no metric table."""
    import rlt2t

    run = copy_prepared(tmp_path / "run")
    for split in ("train", "valid"):
        path = run / "data" / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"id": r["id"], "source": r["source"]}) + "\n"
                                for r in map(json.loads, path.read_text().splitlines())))
    log = tmp_path / "calls.jsonl"
    cfg = _config(run, "grpo", "rl.epochs=1", "rl.train_subset=16", "metric.monitor=reward", "metric.monitor_size=4")
    result = rlt2t.train(cfg, reward=rlt2t.PythonTerm(fn=logged_brevity, params={"log": str(log)}))
    assert result.steps == 2 and result.items_used == 16
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) == 16 * 3 + 4 and all(c["references"] == [] for c in calls)  # K = 3 samples; the monitor's 4
    rows = [json.loads(x) for x in (run / "logs" / "rl" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind", "train") == "train"]
    chunks = [calls[i * 24 : (i + 1) * 24] for i in range(2)]  # one call per chunk of 8 sources, as scored
    assert sorted(r["reward_mean"] for r in train) == pytest.approx(
        sorted(sum(c["score"] for c in chunk) / 24 for chunk in chunks), rel=1e-6)
    [valid] = [r for r in rows if r.get("kind") == "valid"]
    assert valid["monitor"] == pytest.approx(sum(c["score"] for c in calls[-4:]) / 4, rel=1e-9)
    assert "task_score" not in valid and "distinct_outputs" in valid
    assert not (run / "rl" / "document_frequency.json").exists()  # no references to count
