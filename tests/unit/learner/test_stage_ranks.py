"""SFT on two gloo ranks on the CPU (``sft.strategy`` ddp and fsdp; pretraining runs the same loop): FSDP takes
the steps DDP takes (losses, gradient norms, validation scores and the saved weights within 1e-5 over three steps,
tiny BART and T5, T5 also under rl.fsdp's memory options, BART also through LoRA adapters), holds about half the
bytes per rank, and a checkpoint written mid-epoch resumes to the weights of the uninterrupted run bit for bit.
The ranks' driver (Ray actors, ``rlt2t.stage_group``) is tested in tests/integration/test_stage_ranks_ray.py."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlt2t.common.checkpoint import checkpoint_name, load_training_state, read_checkpoint
from rlt2t.common.collate import encode_examples
from rlt2t.common.config import Config, FSDPConfig, LoraConfig, MetricConfig, ModelConfig, RunConfig, SFTConfig
from rlt2t.common.data import Example
from rlt2t.common.policy import Policy, load_policy
from rlt2t.learner.evaluate import monitor_score
from rlt2t.learner.stage_ranks import StageRanks
from rlt2t.learner.stages import run_sft

# 17 examples in batches of 8: two full batches and one of a single example, which rank 1 repeats (each rank
# takes every second example of a batch).
EXAMPLES = [Example(id=f"ex{i}", source=" ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i % 4)),
                    target=" ".join(str(10 + (i * 3 + j) % 50) for j in range(2 + i % 3))) for i in range(17)]
VALID = EXAMPLES[:5]


def _model(family: str) -> ModelConfig:
    return ModelConfig(preset="tiny", family=family, dropout=0.1)


LORA = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)


@pytest.fixture(scope="module")
def family_dir(request, wide_policy_dir) -> tuple[str, Path]:
    """A tiny policy of the family with wide weights (its greedy outputs vary), saved as a model directory.
    ``bart+lora``: BART trained through LoRA adapters (the frozen base sharded, the adapters gathered);
    ``t5+memory``: under rl.fsdp's memory options (recomputed activations, gathered weights kept for the
    backward), which change where the work happens, not the result."""
    return request.param, wide_policy_dir(_model(request.param.partition("+")[0]))


def _sft(variant: str, start: Path, strategy: str, run_dir: Path, resume: Path | None = None) -> None:
    family, _, option = variant.partition("+")
    policy = load_policy(_model(family), checkpoint=resume or start, trainable_adapters=True)
    enc = encode_examples(policy.tokenizer, [e.source for e in EXAMPLES], [e.target for e in EXAMPLES], 16, 16)
    fsdp = FSDPConfig(activation_checkpointing=True, reshard_after_forward=False) if option == "memory" \
        else FSDPConfig()
    cfg = SFTConfig(epochs=1, batch_size=8, lr=1e-3, warmup_ratio=0.0, save_every_steps=2, patience=0,
                    group_by_length=False, strategy=strategy)
    run = RunConfig(dir=str(run_dir), seed=0, log_every=1, progress=False, device="cpu")

    def evaluate(model):
        return monitor_score(Policy(model, policy.tokenizer, policy.origin), VALID, MetricConfig(), max_source_len=16,
                             max_new_tokens=8, by="loss")

    run_sft(policy, enc.sources, enc.targets, cfg, run, run_dir / "sft", evaluate=evaluate, fsdp=fsdp,
            resume_from=read_checkpoint(resume) if resume else None, lora=LORA if option == "lora" else None)


def _rank(rank: int, rendezvous: str, out: str, variant: str, init_dir: str) -> None:
    """DDP's run, FSDP's, and FSDP resumed from its checkpoint after two steps, in this one process group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")  # what rlt2t.stage_group leaves for accelerate
    out_dir, init = Path(out), Path(init_dir)
    for strategy in ("ddp", "fsdp"):
        _sft(variant, init, strategy, out_dir / strategy)
    mid = out_dir / "resumed" / "sft" / "checkpoints" / checkpoint_name(step=2)
    if rank == 0:
        shutil.copytree(out_dir / "fsdp" / "sft" / "checkpoints" / checkpoint_name(step=2), mid)
    dist.barrier()
    _sft(variant, init, "fsdp", out_dir / "resumed", resume=mid)
    dist.barrier()
    os._exit(0)  # no teardown: freeing a DDP module under torch 2.13's gloo can deadlock


def _rows(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in (run_dir / "logs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    return ([r for r in rows if r.get("kind", "train") == "train"],
            [r for r in rows if r.get("kind") == "valid"])


def _weights(run_dir: Path, family: str) -> dict[str, torch.Tensor]:
    """The saved model's weights (an adapter checkpoint's merged into its base)."""
    path = run_dir / "sft" / "checkpoints" / checkpoint_name(epoch=1)
    assert read_checkpoint(path) is not None  # complete: a Hugging Face directory any loader reads
    return load_policy(_model(family), checkpoint=path).model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family_dir", ["bart", "t5", "t5+memory", "bart+lora"], indirect=True)
def test_sft_on_two_ranks_fsdp_steps_as_ddp_with_half_the_bytes_and_resumes_exactly(family_dir, tmp_path,
                                                                                     run_ranks):
    variant, init_dir = family_dir
    family, lora = variant.partition("+")[0], variant.endswith("+lora")
    run_ranks(_rank, (str(tmp_path / "rendezvous"), str(tmp_path), variant, str(init_dir)), deadline_s=240)
    (ddp, ddp_valid), (fsdp, fsdp_valid) = _rows(tmp_path / "ddp"), _rows(tmp_path / "fsdp")
    assert [r["step"] for r in fsdp] == [r["step"] for r in ddp] == [1, 2, 3]  # 17 examples, batches of 8
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], abs=1e-5)
    assert [r["grad_norm"] for r in fsdp] == pytest.approx([r["grad_norm"] for r in ddp], rel=1e-4)
    # The validation pass on the whole, gathered weights: the references' loss and the greedy outputs' variety.
    assert fsdp_valid[0]["valid_loss"] == pytest.approx(ddp_valid[0]["valid_loss"], abs=1e-5)
    assert fsdp_valid[0]["distinct_outputs"] == ddp_valid[0]["distinct_outputs"]
    # Rank 0's parameters and AdamW moments: about half of DDP's whole copy (LoRA: the frozen base as well).
    assert 0.45 < fsdp[-1]["rank_state_bytes"] / ddp[-1]["rank_state_bytes"] < 0.6
    if lora:  # the checkpoints hold the adapters alone, gathered from the shards
        assert (tmp_path / "fsdp" / "sft" / "checkpoints" / checkpoint_name(epoch=1) / "adapter_config.json").is_file()
    start = load_policy(_model(family), checkpoint=init_dir).model.state_dict()
    ddp_w, fsdp_w = _weights(tmp_path / "ddp", family), _weights(tmp_path / "fsdp", family)
    assert set(fsdp_w) == set(ddp_w)
    assert max(float((ddp_w[k] - start[k]).abs().max()) for k in ddp_w) > 1e-3  # three steps moved them
    # Except the attention keys' biases, whose gradient is round-off alone (tests/unit/learner/test_fsdp.py).
    exact = [k for k in ddp_w if not k.endswith("k_proj.bias")]
    assert max(float((fsdp_w[k] - ddp_w[k]).abs().max()) for k in exact) < 1e-5
    # Each rank's own state in its own file of the checkpoint (its RNG; under FSDP its optimizer shard, not in the
    # shared file rank 0 writes); the checkpoint is complete only with them.
    mid = tmp_path / "fsdp" / "sft" / "checkpoints" / checkpoint_name(step=2)
    assert sorted(p.name for p in mid.glob("training_state.rank*.pt")) == [f"training_state.rank{r}.pt" for r in (0, 1)]
    assert "optimizer" not in load_training_state(mid) and "optimizer" in load_training_state(
        tmp_path / "ddp" / "sft" / "checkpoints" / checkpoint_name(step=2))
    assert "training_state.rank1.pt" in read_checkpoint(mid).meta["files"]
    # Resumed after two steps from the mid-epoch checkpoint (each rank its own optimizer shard and RNG; dropout
    # is on): the third step and the saved weights are the uninterrupted run's, exactly.
    resumed, _ = _rows(tmp_path / "resumed")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in fsdp][2:]
    resumed_w = _weights(tmp_path / "resumed", family)
    assert all(torch.equal(resumed_w[k], fsdp_w[k]) for k in fsdp_w)


def test_a_checkpoint_resumes_only_on_the_ranks_that_wrote_it():
    ranks = StageRanks("fsdp", 0, 2)
    ranks.check_layout("sft", "ck", {"strategy": "fsdp", "ranks": 2})
    with pytest.raises(ValueError, match=r"written by 1 rank\(s\) under sft.strategy=local, this run has 2 under "
                                         r"sft.strategy=fsdp; resume with the same sft.strategy and rl.learners"):
        ranks.check_layout("sft", "ck", {})
    StageRanks().check_layout("sft", "ck", {})  # one process, a checkpoint of one process: as always


def test_a_rank_left_without_an_example_repeats_one():
    assert StageRanks("ddp", 1, 2).share([4, 5, 6]) == [5]
    assert StageRanks("ddp", 1, 2).share([4]) == [4]
    assert StageRanks("ddp", 2, 4).share([7, 8]) == [7]
    assert StageRanks().share([4, 5, 6]) == [4, 5, 6]


@pytest.mark.parametrize("change, message", [
    ({"run": {"mixed_precision": "fp16", "device": "cuda"}}, "sft.strategy=fsdp: run.mixed_precision=fp16"),
    ({"sft": {"fgm_epsilon": 0.1}}, "sft.strategy=fsdp: sft.fgm_epsilon"),
])
def test_what_a_sharded_stage_does_not_cover_is_refused_at_config_time(change, message):
    base: dict = {"sft": {"strategy": "fsdp"}, "rl": {"learners": 2}}
    for section, values in change.items():
        base.setdefault(section, {}).update(values)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Config.model_validate(base)
    base["sft"]["strategy"] = "ddp"
    Config.model_validate(base)  # the same run on DDP ranks is fine
