from __future__ import annotations

import pytest
import torch

from rlt2t.common.config import DataConfig, ModelConfig
from rlt2t.common.policy import bart_config, check_lengths, check_preset_holds, load_policy
from rlt2t.common.tokenization import load_tokenizer


def test_preset_matches_tokenizer_and_is_ct2_convertible(ids_tokenizer_dir):
    tok = load_tokenizer(ids_tokenizer_dir)
    cfg = bart_config("tiny", tok)
    assert cfg.vocab_size == len(tok) == 70
    assert cfg.normalize_before is False  # CTranslate2's converter reads it
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (1, 2, 2)
    with pytest.raises(ValueError, match="model.preset"):
        bart_config("huge", tok)


def test_same_seed_same_initial_weights(ids_tokenizer_dir):
    a = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=3).model
    b = load_policy(ModelConfig(preset="tiny", family="bart"), ids_tokenizer_dir, seed=3).model
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_from_pretrained_directory_is_the_same_model(tiny_policy, tmp_path):
    # The path a user with a downloaded facebook/bart-base takes: a saved HF directory.
    tiny_policy.model.save_pretrained(tmp_path)
    tiny_policy.tokenizer.save_pretrained(tmp_path)
    loaded = load_policy(ModelConfig(preset=None, path=str(tmp_path), dropout=0.0))
    x = tiny_policy.tokenizer(["1 2 3"], return_tensors="pt")["input_ids"]
    tiny_policy.model.eval()
    loaded.model.eval()
    out_a = tiny_policy.model.generate(x, max_new_tokens=5, do_sample=False)
    out_b = loaded.model.generate(x, max_new_tokens=5, do_sample=False)
    assert torch.equal(out_a, out_b)
    assert loaded.origin == str(tmp_path)


def test_model_dir_without_tokenizer_uses_tokenizer_dir(tiny_policy, ids_tokenizer_dir, tmp_path):
    tiny_policy.model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.path"):
        load_policy(ModelConfig(), checkpoint=tmp_path)
    assert load_policy(ModelConfig(), ids_tokenizer_dir, checkpoint=tmp_path).tokenizer.pad_token_id == 1


def test_clear_errors(ids_tokenizer_dir, tmp_path, tiny_policy):
    with pytest.raises(FileNotFoundError, match=r"config.json\)$"):
        load_policy(ModelConfig(path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match=r"no config.json\) \(a local directory: a hub name such as .* must be "
                                                r"downloaded first"):
        load_policy(ModelConfig(path="google/flan-t5-small"))  # not on disk: a hub name, as from_pretrained takes
    with pytest.raises(ValueError, match="tokenizer"):
        load_policy(ModelConfig(preset="tiny", family="bart"))
    with pytest.raises(ValueError, match=r"data.max_source_len=300 exceeds the model's 256 positions \(.*\): set "
                                         r"data.max_source_len=256 or lower"):
        check_lengths(tiny_policy, DataConfig(max_source_len=300))


def test_decoding_may_use_every_position_of_the_model(tiny_policy):
    """rollout.max_new_tokens up to the model's positions: the start token takes the first and the last token
    decoded is never fed back, so generate() and the learner's teacher-forced pass on the samples both fit."""
    model, positions = tiny_policy.model.eval(), 256
    check_lengths(tiny_policy, DataConfig(), {"rollout.max_new_tokens": positions})
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=257 exceeds the model's 256 positions .*: set "
                                         r"rollout.max_new_tokens=256 or lower"):
        check_lengths(tiny_policy, DataConfig(), {"rollout.max_new_tokens": positions + 1})
    source = tiny_policy.tokenizer(["11 12 13"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**source, max_new_tokens=positions, min_new_tokens=positions, do_sample=False)
        assert out.shape[1] == positions + 1  # the start token and every position decoded
        model(**source, decoder_input_ids=out[:, :-1])  # the learner's shifted samples: every position, no more
        with pytest.raises(IndexError):
            model(**source, decoder_input_ids=out)


def test_vocabulary_mismatch_is_rejected(tiny_policy, tmp_path):
    from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer

    tiny_policy.model.save_pretrained(tmp_path)
    save_tokenizer(build_ids_tokenizer(500, 4), tmp_path)  # 510 tokens > 70 rows
    with pytest.raises(ValueError, match="convert-model"):
        load_policy(ModelConfig(), checkpoint=tmp_path)


def test_decode_drops_specials(tiny_policy):
    assert tiny_policy.decode([[2, 10 + 5, 10 + 7, 2, 1, 1]]) == ["5 7"]


@pytest.mark.parametrize("family", ["mbart", "t5"])
def test_a_preset_of_another_family_or_shape_than_the_checkpoint_is_refused_naming_the_key(family, ids_tokenizer_dir,
                                                                                          tmp_path):
    """The RL job's rollout workers build model.preset of model.family and load the learner's weights into it: a
    checkpoint of another architecture is refused before any worker starts (the strict load would fail in every
    one of them). The preset it was built from passes; so does model.path, which the workers load themselves."""
    from rlt2t.common.families import FAMILIES

    load_policy(ModelConfig(preset="tiny", family=family), ids_tokenizer_dir, seed=0).model.save_pretrained(tmp_path)
    check_preset_holds(ModelConfig(preset="tiny", family=family), tmp_path, "the RL start")
    check_preset_holds(ModelConfig(preset=None, path=str(tmp_path)), tmp_path, "the RL start")
    other = next(f for f in FAMILIES if f != family and FAMILIES[f].preset)
    with pytest.raises(ValueError, match=f"model.family={other}: the RL start .* is a {family} model.*"
                                         f"set model.family={family}"):
        check_preset_holds(ModelConfig(preset="tiny", family=other), tmp_path, "the RL start")
    with pytest.raises(ValueError, match="model.preset=small .* is 32 wide with 1 layers"):
        check_preset_holds(ModelConfig(preset="small", family=family), tmp_path, "the RL start")
