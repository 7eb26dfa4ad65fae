"""CTranslate2 per family (float32): export from the saved directory, greedy output equal to Hugging Face's token
for token, score_batch within 1e-3 of HF teacher forcing; the warm-started EncoderDecoderModel is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from rlt2t.common.collate import encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.ct2 import Ct2Policy, export_ct2, export_policy
from rlt2t.common.families import UnsupportedModelError, decoder_input_ids
from rlt2t.common.policy import load_policy
from rlt2t.common.scoring import token_scores

FAMILIES = ("bart", "t5", "t5-v1.0", "marian", "mbart", "pegasus")
SOURCES = ["alpha beta gamma delta", "river stone quick", "mu", "red green blue small large tau", "omega psi chi",
           "kappa lambda mu nu xi omicron pi rho"]
TARGETS = ["beta gamma", "stone", "red red blue", "", "alpha omega psi chi phi", "nu"]
MAX_NEW = 8


@pytest.fixture(scope="module")
def exported(family_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("ct2-families")
    out = {}
    for name in FAMILIES:
        policy = load_policy(ModelConfig(preset=None, path=str(family_dirs[name]), dropout=0.0))
        out[name] = (policy, export_ct2(family_dirs[name], root / name, "float32"))
    return out


def hf_greedy(policy, sources):
    model = policy.model.eval()
    batch = policy.tokenizer(sources, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False, num_beams=1).tolist()
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    rows = []
    for row in out:
        row = row[1:]  # the decoder start
        if eos in row:
            row = row[: row.index(eos) + 1]
        else:
            while row and row[-1] == pad and len(row) > 0 and pad != model.config.decoder_start_token_id:
                row.pop()
        rows.append(tuple(row))
    return rows


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_huggingface(name, exported):
    policy, export = exported[name]
    ct2 = Ct2Policy(export)
    got = [hyps[0].token_ids for hyps in ct2.generate(SOURCES, max_new_tokens=MAX_NEW)]
    want = hf_greedy(policy, SOURCES)
    if name in ("t5", "t5-v1.0"):  # no forced EOS: a row cut at the limit has MAX_NEW tokens, padded by HF
        want = [w[:MAX_NEW] for w in want]
    assert got == want
    assert len({g for g in got}) > 1  # not a degenerate constant output


@pytest.mark.parametrize("name", FAMILIES)
def test_scores_match_teacher_forcing(name, exported):
    # Expected: HF teacher forcing over exactly what training puts in a batch for the target (encode_texts with
    # the target template, decoder inputs from the model's decoder start): mBART's labels end `</s> en_XX`.
    policy, export = exported[name]
    tok, model = policy.tokenizer, policy.model.eval()
    got = Ct2Policy(export).score(SOURCES, TARGETS)
    for source, target, lps in zip(SOURCES, TARGETS, got, strict=True):
        labels = torch.tensor(encode_texts(tok, [target], 1 << 20, target=True)[0])
        batch = tok([source], return_tensors="pt")
        with torch.no_grad():
            logits = model(**batch, decoder_input_ids=decoder_input_ids(labels, model.config)).logits
        want = token_scores(logits, labels)[0].tolist()
        assert len(lps) == len(want)
        assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < 1e-3
    if name == "mbart":
        assert encode_texts(tok, ["x"], 99, target=True)[0][0][-2:] == [tok.eos_token_id,
                                                                          tok.convert_tokens_to_ids("en_XX")]


def test_in_memory_export_equals_directory_export(exported, tmp_path):
    policy, export = exported["t5"]
    again = export_policy(policy, tmp_path / "t5", "float32")
    assert ([h[0].token_ids for h in Ct2Policy(again).generate(SOURCES, max_new_tokens=MAX_NEW)]
            == [h[0].token_ids for h in Ct2Policy(export).generate(SOURCES, max_new_tokens=MAX_NEW)])


def test_int8_export_of_every_family_loads(exported, tmp_path, family_dirs):
    for name in ("t5", "marian", "pegasus", "mbart"):
        out = export_ct2(family_dirs[name], tmp_path / name, "int8")
        hyps = Ct2Policy(out).generate(SOURCES[:2], max_new_tokens=4)
        assert all(len(h[0].token_ids) >= 1 for h in hyps)


def test_warm_start_is_refused_with_the_torch_alternative(family_dirs, tmp_path):
    with pytest.raises(UnsupportedModelError, match="CTranslate2 cannot convert encoder-decoder.*torch backend"):
        export_ct2(family_dirs["encoder-decoder"], tmp_path / "out")
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs["encoder-decoder"])))
    with pytest.raises(UnsupportedModelError, match="serve.backend=torch"):
        export_policy(policy, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_marian_decoder_starts_from_its_pad_row_as_huggingface_does(exported, tmp_path):
    # Fine-tuning with tied embeddings moves the <pad> row off zero; CT2's stock Marian loader would start
    # from a zero vector instead of that row and drift from HF.
    policy = copy.deepcopy(exported["marian"][0])
    with torch.no_grad():
        policy.model.get_input_embeddings().weight[policy.model.config.pad_token_id].normal_(0, 1.0)
    out = export_policy(policy, tmp_path / "marian", "float32")
    got = [hyps[0].token_ids for hyps in Ct2Policy(out).generate(SOURCES, max_new_tokens=MAX_NEW)]
    assert got == hf_greedy(policy, SOURCES)
