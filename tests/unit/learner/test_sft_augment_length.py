"""SFT augmentation never lengthens a source past the limit: an augmented source is cut again, keeping its EOS."""

from __future__ import annotations

import torch

from rlt2t.common.collate import encode_texts
from rlt2t.common.config import ModelConfig, RunConfig, SFTConfig
from rlt2t.common.families import max_positions
from rlt2t.common.policy import load_policy
from rlt2t.common.tokenization import template_affixes
from rlt2t.learner.stages import SFTDataset, make_collate, run_sft


def _long_source(tok, limit: int) -> list[int]:
    """A source cut to exactly ``limit`` tokens (EOS last), as encode_examples leaves a long one."""
    ids, truncated = encode_texts(tok, [" ".join(str(i % 60) for i in range(limit + 40))], limit)
    assert truncated == 1 and len(ids[0]) == limit
    return ids[0]


def test_augmented_sources_are_cut_again_to_the_limit_keeping_eos(ids_tokenizer_dir):
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    tok = policy.tokenizer
    limit = max_positions(policy.model.config)
    assert limit is not None
    src = _long_source(tok, limit)
    ds = SFTDataset([src], [[15, tok.eos_token_id]], augment_prob=0.5, protected_ids=set(tok.all_special_ids),
                    seed=1, max_source_len=limit, affixes=template_affixes(tok))
    for epoch in range(4):
        ds.set_epoch(epoch)
        item = ds[0]
        assert len(item["input_ids"]) == limit, "a long source, lengthened by repeats, fills the limit exactly"
        assert item["input_ids"][-1] == tok.eos_token_id
        assert item["input_ids"] != src, "augmentation still applies"
    batch = make_collate(tok.pad_token_id, policy.model.config)([ds[0]])
    with torch.no_grad():
        assert torch.isfinite(policy.model(**batch).loss)


def test_sft_with_augmentation_trains_on_sources_at_the_position_limit(tmp_path, ids_tokenizer_dir):
    """run_sft bounds augmented sources by the model's positions when no data.max_source_len is given (it used to
    raise IndexError in the position embedding: a CUDA device assert on a GPU)."""
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    tok = policy.tokenizer
    src = _long_source(tok, max_positions(policy.model.config))
    run = RunConfig(dir=str(tmp_path), seed=0, device="cpu", progress=False, log_every=1)
    cfg = SFTConfig(epochs=1, batch_size=2, lr=1e-3, augment_prob=0.5, save_every_steps=0)
    result = run_sft(policy, [src, src], [[15, tok.eos_token_id]] * 2, cfg, run, tmp_path / "sft")
    assert result.steps == 1
    # data.max_source_len, when given, is the bound (sources were cut to it; repeats must not lengthen them).
    result = run_sft(policy, [src[-16:]] * 2, [[15, tok.eos_token_id]] * 2, cfg, run, tmp_path / "sft2",
                     max_source_len=16)
    assert result.steps == 1
