"""Reward models on every seq2seq family, warm starts (EncoderDecoderModel) included, and the fp16 refusal
reaching a reward model's backbone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlt2t.common.config import RunConfig, SFTConfig
from rlt2t.common.reward_model import init_reward_model, load_reward_model
from rlt2t.common.tokenization import save_tokenizer
from rlt2t.learner.trainer import train_stage

SOURCES = ["alpha beta", "alpha beta", "red green blue"]
CANDIDATES = ["gamma", "delta eta", "stone"]


@pytest.mark.parametrize("family", ["encoder-decoder", "t5", "bart"])
def test_seq2seq_reward_model_scores_and_round_trips(family_dirs, family, tmp_path):
    model = init_reward_model(family_dirs[family], max_source_len=16, max_candidate_len=16, dropout=0.0)
    assert model.head is not None and model.head.in_features == 32  # every tiny family model is 32 wide
    scores = model.score(SOURCES, CANDIDATES)
    assert scores.shape == (3,) and np.isfinite(scores).all()
    model.save_pretrained(tmp_path)
    save_tokenizer(model.tokenizer, tmp_path)
    assert np.array_equal(load_reward_model(tmp_path).score(SOURCES, CANDIDATES), scores)


def test_warm_start_reward_reads_the_decoder_states_not_its_lm_head(family_dirs):
    """The head reads the BERT decoder's final hidden state at the candidate's last token (EncoderDecoderModel's
    own forward with output_hidden_states gives the same states)."""
    model = init_reward_model(family_dirs["encoder-decoder"], max_source_len=16, max_candidate_len=16, dropout=0.0)
    batch = model.encode(SOURCES[:1], CANDIDATES[:1])
    backbone = model.backbone.eval()
    with torch.no_grad():
        out = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=batch["decoder_input_ids"],
                       decoder_attention_mask=batch["decoder_attention_mask"], output_hidden_states=True)
        expected = model.head(out.decoder_hidden_states[-1][0, -1]).item()
        assert model.eval()(**batch).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_fp16_is_refused_for_a_t5_reward_model(family_dirs, tmp_path):
    model = init_reward_model(family_dirs["t5"], max_source_len=16, max_candidate_len=16, dropout=0.0)

    def step(*_):
        raise AssertionError("train_stage should have refused fp16 before training")

    run = RunConfig(dir=str(tmp_path), device="cpu", mixed_precision="fp16", progress=False)
    with pytest.raises(ValueError, match="run.mixed_precision=fp16: t5"):
        train_stage(stage="reward_model", cfg=SFTConfig(epochs=1, batch_size=1), run=run, model=model,
                    tokenizer=model.tokenizer, dataset=[{}], collate=lambda items: {}, step_fn=step,
                    out_dir=tmp_path)
