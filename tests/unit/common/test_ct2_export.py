"""`rlt2t export` (rlt2t.common.ct2.export_ct2) reads checkpoints and replaces --out as a whole: an --out where
the inputs are is refused before anything is converted; a LoRA adapter checkpoint exports merged into its base
(and predict takes it as a generator or scorer)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rlt2t.cli import main
from rlt2t.common.checkpoint import complete_checkpoints, save_checkpoint
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import Config, LoraConfig, ModelConfig
from rlt2t.common.ct2 import Ct2Policy, export_ct2, read_export_info, source_checksum
from rlt2t.common.lora import apply_lora
from rlt2t.common.policy import load_policy
from rlt2t.common.scoring import token_scores
from rlt2t.common.tokenization import save_tokenizer
from rlt2t.ensemble import resolve_model
from rlt2t.jobs import export_job

SOURCES = ["1 2 3 4", "10 11 12", "40 41 42 43 44 45", "7"]
TARGETS = ["5 6", "13", "", "8 9 10 11"]


@pytest.fixture
def checkpoint_root(tmp_path, tiny_policy) -> Path:
    """{run}/rl/checkpoints with two complete rlt2t checkpoints of the tiny policy."""
    root = tmp_path / "run" / "rl" / "checkpoints"
    for e in (1, 2):
        save_checkpoint(root, f"epoch-000{e}", model=tiny_policy.model, tokenizer=tiny_policy.tokenizer, step=e,
                        training_state={"x": e})
    return root


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_out_that_is_contains_or_lies_inside_the_checkpoint_is_refused_before_converting(
        checkpoint_root, tmp_path, monkeypatch):
    import rlt2t.common.ct2 as ct2

    monkeypatch.setattr(ct2, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    before = _snapshot(tmp_path / "run")
    newest = checkpoint_root / "epoch-0002"
    (tmp_path / "link").symlink_to(checkpoint_root.parent)
    cases = [
        (newest, "is the input"),                              # the checkpoint itself
        (checkpoint_root, "contains the input"),               # its root
        (checkpoint_root.parent, "contains the input"),        # a folder above it (the stage)
        (tmp_path / "run", "contains the input"),
        (tmp_path / "link", "contains the input"),             # the same folder through a symlink
        (newest / "export", "is inside the input"),            # inside it
        (checkpoint_root / "epoch-0001", "is inside the input"),  # another checkpoint of the root
        (checkpoint_root / "export", "is inside the input"),   # among the checkpoints
    ]
    for out, what in cases:
        with pytest.raises(ValueError, match=f"--out {out} {what}"):
            export_ct2(newest, out, "float32", force=True)  # --force does not lift it
    assert _snapshot(tmp_path / "run") == before
    assert [i.path.name for i in complete_checkpoints(checkpoint_root)] == ["epoch-0001", "epoch-0002"]


def test_export_job_over_its_checkpoint_root_keeps_the_checkpoints(checkpoint_root, tmp_path, ids_tokenizer_dir):
    # The reviewer's repro: `rlt2t export --checkpoint {run}/rl/checkpoints --out {run}/rl --force`.
    cfg = Config.model_validate({"run": {"dir": str(tmp_path / "run")}, "tokenizer": {"path": str(ids_tokenizer_dir)}})
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ValueError, match="--out .* contains the input .*epoch-0002"):
        export_job(cfg, checkpoint_root, checkpoint_root.parent, force=True)
    with pytest.raises(ValueError, match="--out .* is the input"):
        export_job(cfg, checkpoint_root, ids_tokenizer_dir, force=True)  # the tokenizer it reads
    assert _snapshot(tmp_path / "run") == before
    assert os.listdir(ids_tokenizer_dir)


def test_cli_export_over_the_checkpoints_exits_2(checkpoint_root, tmp_path, capsys):
    before = _snapshot(tmp_path / "run")
    code = main(["export", "--checkpoint", str(checkpoint_root), "--out", str(checkpoint_root), "--force",
                 f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and "contains the input" in err
    assert _snapshot(tmp_path / "run") == before


def test_export_beside_the_checkpoints_still_works(checkpoint_root, tmp_path):
    out = export_ct2(checkpoint_root / "epoch-0002", tmp_path / "run" / "export" / "rl", "float32")
    assert Ct2Policy(out).generate(SOURCES[:1], max_new_tokens=4)[0]
    with pytest.raises(FileExistsError, match="--out .* already exists .*--force"):
        export_ct2(checkpoint_root / "epoch-0002", out, "float32")


# --- LoRA adapter checkpoints --------------------------------------------------------------------------------


@pytest.fixture
def adapter_root(tmp_path, ids_tokenizer_dir) -> tuple[Path, Path]:
    """(base model dir, checkpoint root of an adapter checkpoint on it whose adapters change the outputs)."""
    base = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    base_dir = tmp_path / "base"
    base.model.save_pretrained(base_dir)
    save_tokenizer(base.tokenizer, base_dir)
    policy = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=base_dir)
    model = apply_lora(policy.model, LoraConfig(r=4, dropout=0.0))
    model.peft_config["default"].base_model_name_or_path = str(base_dir.resolve())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    root = tmp_path / "sft" / "checkpoints"
    save_checkpoint(root, "epoch-0001", model=model, tokenizer=policy.tokenizer, step=1)
    assert (root / "epoch-0001" / "adapter_config.json").is_file()
    assert not (root / "epoch-0001" / "config.json").exists()
    return base_dir, root


def _hf_scores(policy, sources, targets):
    src, _ = encode_texts(policy.tokenizer, sources, 256)
    tgt, _ = encode_texts(policy.tokenizer, targets, 256, target=True)
    batch = collate_seq2seq(src, tgt, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = policy.model.eval()(**batch).logits
    scores = token_scores(logits, batch["labels"], "logprobs")
    return [scores[i, : len(t)].tolist() for i, t in enumerate(tgt)]


def test_an_adapter_checkpoint_exports_merged_into_its_base(adapter_root, tmp_path):
    base_dir, root = adapter_root
    ckpt = root / "epoch-0001"
    out = export_ct2(ckpt, tmp_path / "export", "float32")
    merged = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=ckpt)
    base = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=base_dir)
    ct2 = Ct2Policy(out)
    got = ct2.score(SOURCES, TARGETS)
    want, plain = _hf_scores(merged, SOURCES, TARGETS), _hf_scores(base, SOURCES, TARGETS)
    assert max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-3
    assert max(abs(a - b) for g, w in zip(got, plain, strict=True) for a, b in zip(g, w, strict=True)) > 1e-2
    info = read_export_info(out)
    assert info["source"] == str(ckpt.resolve()) and info["source_sha256"] == source_checksum(ckpt)
    # Its base is read too: --out there is refused.
    with pytest.raises(ValueError, match="--out .* is the input"):
        export_ct2(ckpt, base_dir, "float32", force=True)
    assert (base_dir / "config.json").is_file()


def test_predict_takes_an_adapter_checkpoint_root(adapter_root, tmp_path):
    _, root = adapter_root
    cfg = Config.model_validate({"run": {"dir": str(tmp_path / "run")}})
    kind, path = resolve_model(cfg, root, "generators")
    assert kind == "ct2" and path.parent == tmp_path / "run" / "export" / "cache"
    assert Ct2Policy(path).generate(SOURCES[:2], max_new_tokens=4)[0]
    assert resolve_model(cfg, root, "scorers") == (kind, path)  # cached: the same export again
