"""An encoder reward model's backbone settings: ``reward_model.dropout`` reaches every dropout of the backbone (init
and load, the path ``--resume`` takes) and leaves eval-mode scores alone; limits whose longest pair the backbone's
positions cannot hold are refused when the model is built or loaded, and the longest pair that fits scores."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    BertTokenizer,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from rlt2t.common.reward_model import SPEC_FILE, RewardModel, RewardModelSpec, init_reward_model, load_reward_model
from rlt2t.common.tokenization import save_tokenizer

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert-vocab") / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizer(str(path))


def tiny(tok, **extra) -> dict:
    return dict(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                pad_token_id=tok.pad_token_id, **extra)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory, tok):
    """A bare BERT encoder saved with its default dropouts (0.1 hidden and attention), as MiniLM ships."""
    out = tmp_path_factory.mktemp("bert-encoder")
    torch.manual_seed(0)
    BertModel(BertConfig(**tiny(tok, max_position_embeddings=32))).save_pretrained(out)
    save_tokenizer(tok, out)
    return out


def text(first: int, n: int) -> str:
    return " ".join(WORDS[(first + i) % len(WORDS)] for i in range(n))


def dropouts(model: RewardModel) -> set[float]:
    config = model.backbone.config
    probs = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
    return probs | {config.hidden_dropout_prob, config.attention_probs_dropout_prob}


def test_the_configured_dropout_reaches_an_encoder_backbone_at_init_and_load(encoder_dir, tmp_path, tok):
    model = init_reward_model(encoder_dir, max_source_len=8, max_candidate_len=8, dropout=0.0)
    assert dropouts(model) == {0.0}
    model.train()
    batch = model.encode([text(0, 5), text(3, 2)], [text(9, 3), text(1, 6)])
    with torch.no_grad():
        assert torch.equal(model(**batch), model(**batch))  # no dropout: train mode is deterministic
    assert dropouts(init_reward_model(encoder_dir, max_source_len=8, max_candidate_len=8, dropout=0.3)) == {0.3}

    model.save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    resumed = load_reward_model(tmp_path, dropout=0.25)  # what `reward-model train --resume` does
    assert dropouts(resumed) == {0.25}
    served = load_reward_model(tmp_path)  # the reward server's and `reward-model score`'s load
    sources, candidates = [text(0, 5), text(3, 2)], [text(9, 3), text(1, 6)]
    np.testing.assert_array_equal(resumed.score(sources, candidates), served.score(sources, candidates))


def test_a_classifier_dropout_the_directory_sets_follows_the_configured_one(tmp_path, tok):
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**tiny(tok, max_position_embeddings=32, num_labels=3,
                                                     classifier_dropout=0.2))).save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    model = init_reward_model(tmp_path, max_source_len=8, max_candidate_len=8, dropout=0.0)
    assert model.backbone.config.classifier_dropout == 0.0 and dropouts(model) == {0.0}
    assert model.backbone.config.num_labels == 1


@pytest.mark.parametrize("arch", ["bert", "roberta"])
def test_limits_beyond_the_backbones_positions_are_refused_and_the_longest_pair_that_fits_scores(tok, arch):
    """BERT: 32 positions; RoBERTa's 34 rows start after the padding index (0 here): 33 positions. A pair is
    [CLS] source [SEP] candidate [SEP]: at most (max_source_len − 2) + (max_candidate_len − 2) + 3 tokens."""
    if arch == "bert":
        backbone, limit = BertForSequenceClassification(BertConfig(**tiny(tok, max_position_embeddings=32,
                                                                          num_labels=1))), 32
    else:
        backbone, limit = RobertaForSequenceClassification(RobertaConfig(**tiny(tok, max_position_embeddings=34,
                                                                                num_labels=1))), 33
    backbone.eval()
    fits = RewardModelSpec("encoder", 16, limit + 1 - 16)  # longest pair: exactly `limit` tokens
    model = RewardModel(backbone, tok, fits)
    batch = model.encode([text(0, 40)], [text(5, 40)])
    assert batch["input_ids"].shape == (1, limit)
    assert np.isfinite(model.score([text(0, 40)], [text(5, 40)])).all()

    too_long = RewardModelSpec("encoder", 16, limit + 2 - 16)
    with pytest.raises(ValueError, match=rf"reward_model\.max_source_len=16 \+ reward_model\.max_candidate_len="
                                         rf"{limit + 2 - 16}: .* {limit + 1} tokens .* at most {limit} positions"):
        RewardModel(backbone, tok, too_long)


def test_impossible_limits_fail_at_init_and_load_not_mid_training(encoder_dir, tmp_path, tok):
    with pytest.raises(ValueError, match=r"reward_model\.max_source_len=30 .* at most 32 positions"):
        init_reward_model(encoder_dir, max_source_len=30, max_candidate_len=8, dropout=0.0)

    model = init_reward_model(encoder_dir, max_source_len=8, max_candidate_len=8, dropout=0.0)
    model.save_pretrained(tmp_path)
    save_tokenizer(tok, tmp_path)
    spec = json.loads((tmp_path / SPEC_FILE).read_text())
    (tmp_path / SPEC_FILE).write_text(json.dumps({**spec, "max_source_len": 30}))  # e.g. a backbone swapped under it
    with pytest.raises(ValueError, match=rf"{SPEC_FILE}: reward_model\.max_source_len=30 .* at most 32 positions.*"
                                         r"the saved model's limits: retrain it"):
        load_reward_model(tmp_path)


def test_a_seq2seq_backbones_positions_bound_the_source_and_candidate_limits(family_dirs):
    """BART (128 learned positions here): the source takes the encoder's, the candidate after the decoder start
    token the decoder's; limits beyond them are refused at build, and the longest that fit score. T5 (relative
    positions) takes any."""
    bart = family_dirs["bart"]
    with pytest.raises(ValueError, match=r"reward_model\.max_source_len=129: 129 positions, but the bart backbone "
                                         r"has 128; set it to at most 128"):
        init_reward_model(bart, max_source_len=129, max_candidate_len=8)
    with pytest.raises(ValueError, match=r"reward_model\.max_candidate_len=128: 129 positions after the decoder "
                                         r"start token, but the bart backbone has 128; set it to at most 127"):
        init_reward_model(bart, max_source_len=16, max_candidate_len=128)
    model = init_reward_model(bart, max_source_len=128, max_candidate_len=127, dropout=0.0).eval()
    long = " ".join(["alpha beta"] * 200)  # far past both limits: cut to them
    scores = model.score([long, "alpha"], [long, "beta"])
    assert np.isfinite(scores).all()
    # the longest inputs fill the positions; one more and BART's forward fails: the check guards a real limit
    enc = model.encode([long], [long])
    assert enc["input_ids"].shape[1] == 128 and enc["decoder_input_ids"].shape[1] == 128
    with pytest.raises(IndexError):
        model.backbone(input_ids=torch.cat([enc["input_ids"], enc["input_ids"][:, :1]], dim=1))
    t5 = init_reward_model(family_dirs["t5"], max_source_len=4096, max_candidate_len=4096)
    assert t5.spec.max_source_len == 4096
