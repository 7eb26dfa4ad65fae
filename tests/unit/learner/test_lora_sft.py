"""SFT with LoRA: adapters alone train and are checkpointed; the base stays frozen; resume is bitwise."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlt2t.common.checkpoint import (
    complete_checkpoints,
    latest_complete_checkpoint,
    load_training_state,
    read_checkpoint,
)
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import LoraConfig, ModelConfig, RunConfig, SFTConfig
from rlt2t.common.lora import adapter_state_dict, load_lora_policy, load_merged_policy, save_merged_model
from rlt2t.common.policy import is_adapter_checkpoint, load_policy
from rlt2t.common.tokenization import save_tokenizer
from rlt2t.learner.stages import run_sft

MC = ModelConfig(preset="tiny", family="bart", dropout=0.1)
LORA = LoraConfig(enabled=True, r=4, alpha=8.0, dropout=0.1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, ids_tokenizer_dir):
    """A 'pretrained' base: the tiny preset saved as a model directory."""
    out = tmp_path_factory.mktemp("base")
    policy = load_policy(MC, ids_tokenizer_dir, seed=0)
    policy.model.save_pretrained(out)
    save_tokenizer(policy.tokenizer, out)
    return out


def _task(tok, n=64, seed=0):
    rng = random.Random(seed)
    src = [" ".join(str(rng.randrange(60)) for _ in range(rng.randint(3, 8))) for _ in range(n)]
    tgt = [" ".join(sorted(s.split(), key=int)[:2]) for s in src]
    return encode_texts(tok, src, 32)[0], encode_texts(tok, tgt, 16)[0]


def _run(tmp_path, name):
    return RunConfig(dir=str(tmp_path / name), seed=5, device="cpu", progress=False, log_every=2)


CFG = SFTConfig(epochs=2, batch_size=16, lr=1e-2, warmup_ratio=0.2, save_every_steps=3, keep_last=50,
                augment_prob=0.15, rdrop_alpha=1.0)


def _train(tmp_path, name, base_dir, ids_tokenizer_dir):
    policy = load_policy(MC, ids_tokenizer_dir, checkpoint=base_dir)
    src, tgt = _task(policy.tokenizer)
    result = run_sft(policy, src, tgt, CFG, _run(tmp_path, name), tmp_path / name, lora=LORA)
    return result, src, tgt


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, base_dir, ids_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("lora_full")
    result, src, tgt = _train(tmp, "full", base_dir, ids_tokenizer_dir)
    return tmp, result, src, tgt


def test_only_adapters_train_and_are_checkpointed(full_run, base_dir, ids_tokenizer_dir):
    tmp, result, src, tgt = full_run
    assert result.steps == 8
    ckpt = result.checkpoint
    assert is_adapter_checkpoint(ckpt) and (ckpt / "adapter_model.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists() and not (ckpt / "config.json").exists()
    adapters = load_file(ckpt / "adapter_model.safetensors")
    assert adapters and all("lora_A" in k or "lora_B" in k for k in adapters)
    # The optimizer held the adapters only: one Adam state per adapter tensor.
    state = load_training_state(ckpt)
    assert len(state["optimizer"]["state"]) == len(adapters)
    # The frozen base is bit for bit the base directory's, and the adapters moved.
    trained = load_lora_policy(MC, ids_tokenizer_dir, ckpt).model
    base = load_policy(MC, ids_tokenizer_dir, checkpoint=base_dir).model.state_dict()
    frozen = trained.get_base_model().state_dict()
    for name, value in base.items():
        key = name.replace(".q_proj.weight", ".q_proj.base_layer.weight").replace(".v_proj.weight",
                                                                               ".v_proj.base_layer.weight")
        key = key.replace(".q_proj.bias", ".q_proj.base_layer.bias").replace(".v_proj.bias", ".v_proj.base_layer.bias")
        assert torch.equal(frozen[key], value), name
    assert any(v.abs().sum() > 0 for k, v in adapter_state_dict(trained).items() if "lora_B" in k)


def test_merged_policy_matches_the_adapter_policy(full_run, ids_tokenizer_dir):
    tmp, result, src, tgt = full_run
    lora = load_lora_policy(MC, ids_tokenizer_dir, result.checkpoint)
    merged = load_merged_policy(MC, ids_tokenizer_dir, result.checkpoint)
    # Written out as a plain model directory (for CTranslate2 export), it loads like any other.
    saved = load_policy(MC, None, checkpoint=save_merged_model(MC, ids_tokenizer_dir, result.checkpoint,
                                                               tmp / "merged"))
    batch = collate_seq2seq(src[:8], tgt[:8], lora.tokenizer.pad_token_id)
    lora.model.eval(), merged.model.eval(), saved.model.eval()
    with torch.no_grad():
        expected = lora.model(**batch).logits
        assert torch.allclose(merged.model(**batch).logits, expected, atol=1e-5, rtol=0)
        assert torch.equal(saved.model(**batch).logits, merged.model(**batch).logits)


@pytest.mark.parametrize("kill_after", ["step-000003", "epoch-0001"])
def test_kill_and_resume_is_bitwise(full_run, base_dir, ids_tokenizer_dir, kill_after):
    tmp, result, src, tgt = full_run
    reference = adapter_state_dict(load_lora_policy(MC, ids_tokenizer_dir, result.checkpoint).model)
    name = f"part-{kill_after}"
    _train(tmp, name, base_dir, ids_tokenizer_dir)
    root = tmp / name / "checkpoints"
    keep = read_checkpoint(root / kill_after)
    for info in complete_checkpoints(root):
        if info.step > keep.step:
            shutil.rmtree(info.path)
    assert latest_complete_checkpoint(root) == keep.path
    resumed = load_lora_policy(MC, ids_tokenizer_dir, keep.path)
    again = run_sft(resumed, src, tgt, CFG, _run(tmp, name), tmp / name, resume_from=keep, lora=LORA)
    assert again.steps == 8
    after = adapter_state_dict(resumed.model)
    assert after.keys() == reference.keys()
    assert all(torch.equal(reference[k], after[k]) for k in reference), "resumed LoRA run diverged"


def test_lora_refuses_a_from_scratch_base_and_fgm(tmp_path, ids_tokenizer_dir, base_dir):
    scratch = load_policy(MC, ids_tokenizer_dir, seed=0)
    src, tgt = _task(scratch.tokenizer, n=16)
    with pytest.raises(ValueError, match="model.lora: LoRA adapts a pretrained base"):
        run_sft(scratch, src, tgt, CFG, _run(tmp_path, "s"), tmp_path / "s", lora=LORA)
    pretrained = load_policy(MC, ids_tokenizer_dir, checkpoint=base_dir)
    with pytest.raises(ValueError, match="sft.fgm_epsilon"):
        run_sft(pretrained, src, tgt, CFG.model_copy(update={"fgm_epsilon": 1.0}), _run(tmp_path, "f"),
                tmp_path / "f", lora=LORA)
