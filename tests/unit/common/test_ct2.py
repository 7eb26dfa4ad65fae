"""Tests for rlt2t.common.ct2: export, CT2-vs-HF parity (greedy, teacher-forced scores, int8), the sampler.

The tiny BART is perturbed with seeded N(0, 4 / fan_in) weights and an EOS logit bias, so that its outputs
depend on the source and some greedy decodes stop early while others run into the token limit (where HF
forces the EOS and the CT2 wrapper must do the same).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import torch

from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.ct2 import (
    EXPORT_INFO,
    Ct2Policy,
    cpu_copy,
    ct2_sampler_from_state_dict,
    export_ct2,
    read_export_info,
    sample_ct2,
)
from rlt2t.common.policy import Policy, load_policy
from rlt2t.common.scoring import token_scores
from rlt2t.common.tokenization import save_tokenizer

MAX_NEW = 12
NUM_INPUTS = 64
# int8 on CPU quantises weights per output row *and* activations per row, dynamically, each to 127 steps
# of the row's largest magnitude: every dot product carries about 1% relative error. On this deliberately
# wide-weighted 32-dim model that moves token log-probs by 0.06 on average and 0.58 at worst over the
# 64 x ~11 positions below (measured), and flips 19 of 64 greedy decodes at near-ties. The bounds leave
# about 2x room; a wrong graph or a shifted position moves log-probs by whole units and fails them, and
# the sequence-level correlation is what reranking relies on.
INT8_MEAN_ABS_TOL = 0.15
INT8_MAX_ABS_TOL = 1.0
INT8_MIN_SEQUENCE_CORRELATION = 0.99
INT8_MIN_EQUAL_FRACTION = 0.5


def random_sources(n: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=gen).tolist()
    return [" ".join(str(t) for t in torch.randint(0, 60, (m,), generator=gen).tolist()) for m in lengths]


def perturbed_policy(tokenizer_dir, seed: int = 1, eos_bias: float = 2.0) -> Policy:
    policy = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), tokenizer_dir, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / param.shape[-1] ** 0.5)
        policy.model.final_logits_bias[0, policy.tokenizer.eos_token_id] = eos_bias
    policy.model.eval()
    return policy


@pytest.fixture(scope="module")
def policy(ids_tokenizer_dir) -> Policy:
    return perturbed_policy(ids_tokenizer_dir)


@pytest.fixture(scope="module")
def model_dir(policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    policy.model.save_pretrained(out)
    save_tokenizer(policy.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def export_f32(model_dir, tmp_path_factory):
    return export_ct2(model_dir, tmp_path_factory.mktemp("exp") / "f32", "float32")


@pytest.fixture(scope="module")
def export_int8(model_dir, tmp_path_factory):
    return export_ct2(model_dir, tmp_path_factory.mktemp("exp") / "int8", "int8")


def hf_greedy(policy: Policy, sources: list[str], max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    """HF greedy ids per source, without the decoder start token, cut after the first EOS."""
    ids, _ = encode_texts(policy.tokenizer, sources, 256)
    batch = collate_seq2seq(ids, None, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        out = policy.model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    eos = policy.tokenizer.eos_token_id
    rows = []
    for row in out.tolist():
        row = row[1:]
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def hf_logprobs(policy: Policy, sources: list[str], targets: list[str]) -> list[list[float]]:
    """HF teacher-forced log-probs of labels = tokenizer(target) (EOS included), per target token."""
    src, _ = encode_texts(policy.tokenizer, sources, 256)
    tgt, _ = encode_texts(policy.tokenizer, targets, 256)
    batch = collate_seq2seq(src, tgt, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = policy.model(**batch).logits
    scores = token_scores(logits, batch["labels"], "logprobs")
    return [scores[i, : len(t)].tolist() for i, t in enumerate(tgt)]


# --- export ------------------------------------------------------------------------------------------------


def test_export_writes_model_tokenizer_and_info(export_f32, model_dir, policy):
    assert (export_f32 / "model.bin").is_file()
    assert (export_f32 / "tokenizer.json").is_file()
    info = read_export_info(export_f32)
    assert info["quantization"] == "float32"
    assert info["vocab_size"] == len(policy.tokenizer) == 70
    assert info["special_ids"] == {"pad": 1, "bos": 0, "eos": 2, "unk": 3, "decoder_start": 2, "forced_eos": 2}
    assert info["source_sha256"] == hashlib.sha256(
        b"model.safetensors" + (model_dir / "model.safetensors").read_bytes()).hexdigest()
    ct2_config = json.loads((export_f32 / "config.json").read_text())
    assert ct2_config["decoder_start_token"] == "</s>" and ct2_config["add_source_eos"] is False
    assert not list(export_f32.parent.glob(".tmp-*"))  # written atomically, nothing left behind


def test_export_errors(model_dir, tmp_path, export_f32):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        export_ct2(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="quantization: unknown 'int4'"):
        export_ct2(model_dir, tmp_path / "out", "int4")
    with pytest.raises(FileExistsError, match="already exists"):
        export_ct2(model_dir, export_f32)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    with pytest.raises(ValueError, match="holds no tokenizer"):
        export_ct2(bare, tmp_path / "out")
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not an encoder-decoder"):
        export_ct2(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_patches_missing_normalize_before(model_dir, ids_tokenizer_dir, tmp_path, export_f32):
    """A config without normalize_before (and a directory without tokenizer) exports like the original."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("generation_config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("normalize_before")
    (bare / "config.json").write_text(json.dumps(config))
    out = export_ct2(bare, tmp_path / "exp", "float32", tokenizer_dir=ids_tokenizer_dir)
    assert "normalize_before" not in json.loads((bare / "config.json").read_text())  # source untouched
    sources = random_sources(8, seed=5)
    got = [h[0].token_ids for h in Ct2Policy(out).generate(sources, max_new_tokens=MAX_NEW)]
    assert got == [h[0].token_ids for h in Ct2Policy(export_f32).generate(sources, max_new_tokens=MAX_NEW)]


# --- parity --------------------------------------------------------------------------------------------------


def test_float32_greedy_equals_hf_on_64_inputs(export_f32, policy):
    sources = random_sources(NUM_INPUTS, seed=3)
    expected = hf_greedy(policy, sources)
    got = Ct2Policy(export_f32, intra_threads=1).generate(sources, max_new_tokens=MAX_NEW)
    assert [list(h[0].token_ids) for h in got] == expected
    # Both branches were exercised: rows that stopped by themselves and rows that hit the forced EOS.
    lengths = {len(row) for row in expected}
    assert min(lengths) < MAX_NEW and MAX_NEW in lengths
    assert len({tuple(row) for row in expected}) > NUM_INPUTS // 3  # outputs depend on the source
    assert got[0][0].text == policy.decode([expected[0]])[0]


def test_float32_score_equals_hf_teacher_forcing(export_f32, policy):
    sources = random_sources(NUM_INPUTS, seed=4)
    targets = random_sources(NUM_INPUTS, seed=9)
    expected = hf_logprobs(policy, sources, targets)
    got = Ct2Policy(export_f32, intra_threads=1).score(sources, targets)
    assert [len(g) for g in got] == [len(t.split()) + 1 for t in targets]  # one per token, plus EOS
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, abs=1e-3)


def test_int8_within_stated_tolerance(export_int8, policy):
    sources = random_sources(NUM_INPUTS, seed=4)
    targets = random_sources(NUM_INPUTS, seed=9)
    ct2 = Ct2Policy(export_int8, intra_threads=1)
    assert read_export_info(export_int8)["quantization"] == "int8"
    got_lp, hf_lp = ct2.score(sources, targets), hf_logprobs(policy, sources, targets)
    diffs = np.array([abs(a - b) for g, e in zip(got_lp, hf_lp, strict=True) for a, b in zip(g, e, strict=True)])
    assert 0 < diffs.mean() < INT8_MEAN_ABS_TOL  # > 0: it really is quantised
    assert diffs.max() < INT8_MAX_ABS_TOL
    correlation = np.corrcoef([sum(g) for g in got_lp], [sum(e) for e in hf_lp])[0, 1]
    assert correlation > INT8_MIN_SEQUENCE_CORRELATION
    expected = hf_greedy(policy, sources)
    got = [list(h[0].token_ids) for h in ct2.generate(sources, max_new_tokens=MAX_NEW)]
    equal = sum(g == e for g, e in zip(got, expected, strict=True))
    assert equal >= INT8_MIN_EQUAL_FRACTION * NUM_INPUTS


def test_beam_search_hypotheses(export_f32, policy):
    ct2 = Ct2Policy(export_f32)
    hyps = ct2.generate(random_sources(4, seed=2), beam_size=4, num_hypotheses=3, max_new_tokens=MAX_NEW)
    assert [len(h) for h in hyps] == [3, 3, 3, 3]
    for per_source in hyps:
        assert [h.score for h in per_source] == sorted((h.score for h in per_source), reverse=True)
        assert all(h.token_ids[-1] == 2 for h in per_source)
    with pytest.raises(ValueError, match="exceeds beam_size"):
        ct2.generate(["1"], beam_size=2, num_hypotheses=3)


# --- the rollout sampler -----------------------------------------------------------------------------------


def test_sample_ct2_row_layout(export_f32, policy):
    ct2 = Ct2Policy(export_f32)
    sources = random_sources(5, seed=6)
    k = 3
    # top_k=1 is greedy: every one of source i's rows must be source i's greedy decode.
    greedy = sample_ct2(ct2, sources, k, top_k=1, temperature=0.8, max_new_tokens=MAX_NEW, seed=0)
    assert greedy == [row for row in hf_greedy(policy, sources) for _ in range(k)]
    rows = sample_ct2(ct2, sources, k, top_k=2, temperature=0.8, max_new_tokens=MAX_NEW, seed=11)
    assert len(rows) == len(sources) * k
    assert all(1 <= len(r) <= MAX_NEW and r[-1] == 2 for r in rows)  # EOS last: stopped or forced
    # The first token of row i*k+j is one of source i's two most likely first tokens.
    ids, _ = encode_texts(policy.tokenizer, sources, 256)
    batch = collate_seq2seq(ids, None, 1)
    start = torch.full((len(sources), 1), 2)
    with torch.no_grad():
        first = policy.model(**batch, decoder_input_ids=start).logits[:, 0].topk(2).indices.tolist()
    for i in range(len(sources)):
        assert {rows[i * k + j][0] for j in range(k)} <= set(first[i])


def test_sample_ct2_reproducible_with_seed(export_f32):
    ct2 = Ct2Policy(export_f32, intra_threads=2)
    sources = random_sources(6, seed=7)
    a = sample_ct2(ct2, sources, 4, top_k=0, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)
    sample_ct2(ct2, sources, 4, top_k=0, temperature=1.0, max_new_tokens=MAX_NEW, seed=6)
    b = sample_ct2(ct2, sources, 4, top_k=0, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)
    c = sample_ct2(Ct2Policy(export_f32), sources, 4, top_k=0, temperature=1.0, max_new_tokens=MAX_NEW, seed=6)
    assert a == b
    assert a != c
    assert len({tuple(r) for r in a}) > len(a) // 2  # really sampling, not greedy
    with pytest.raises(ValueError, match="k must be >= 1"):
        sample_ct2(ct2, sources, 0, top_k=3, temperature=1.0, max_new_tokens=4, seed=1)


def test_sampler_from_state_dict_tracks_published_weights(policy, ids_tokenizer_dir, export_f32, tmp_path):
    """A worker's policy with other weights, given the published state dict, samples like the export."""
    worker = perturbed_policy(ids_tokenizer_dir, seed=99)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    sampler = ct2_sampler_from_state_dict(worker, state, tmp_path, "float32", intra_threads=1)
    sources = random_sources(16, seed=8)
    expected = [h[0].token_ids for h in Ct2Policy(export_f32).generate(sources, max_new_tokens=MAX_NEW)]
    assert [h[0].token_ids for h in sampler.generate(sources, max_new_tokens=MAX_NEW)] == expected
    # int8 conversion reads the live model: it must not quantise the worker's torch weights in place.
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    int8 = ct2_sampler_from_state_dict(worker, None, tmp_path, "int8", name="v2")
    assert all(torch.equal(v, worker.model.state_dict()[k]) for k, v in before.items())
    assert (tmp_path / "v2" / EXPORT_INFO).is_file() and read_export_info(int8.export_dir)["quantization"] == "int8"
    with pytest.raises(ValueError, match="compute_type: unknown"):
        ct2_sampler_from_state_dict(worker, None, tmp_path, "int3")


def test_sampled_rows_the_tokenizer_has_no_name_for_keep_their_own_ids(ids_tokenizer_dir, tmp_path):
    """A model with more output rows than its tokenizer has tokens (T5 pads to a multiple of 128; a model grown
    by `convert-model --vocab-size`): a sampled extra row comes back as that row's id, not as <unk>, so the
    sampler's log-probs are those of the tokens the learner trains on."""
    from rlt2t.common.ct2 import ct2_sampler_from_state_dict, sample_ct2_logprobs
    from rlt2t.common.scoring import sequence_logprobs

    pol = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=0)
    named = len(pol.tokenizer)
    pol.model.resize_token_embeddings(named + 8, mean_resizing=False)
    pol.model.eval()
    with torch.no_grad():
        pol.model.final_logits_bias[0, named:] = 4.0  # make the unnamed rows likely
    ct2 = ct2_sampler_from_state_dict(pol, None, tmp_path, "float32", max_source_len=16)
    sources = ["12 7 33", "5 6 40 41"]
    rows = sample_ct2_logprobs(ct2, sources, 4, 0, 1.0, 6, seed=1)
    ids = [r.token_ids for r in rows]
    assert any(i >= named for seq in ids for i in seq)  # extra rows were drawn
    assert pol.tokenizer.unk_token_id not in {i for seq in ids for i in seq}
    enc, _ = encode_texts(pol.tokenizer, sources, 16)
    batch = collate_seq2seq(enc, None, pol.tokenizer.pad_token_id)
    learner = sequence_logprobs(pol.model, batch["input_ids"], batch["attention_mask"], ids, 4)
    for row, ref in zip(rows, learner, strict=True):
        drawn = row.sample_logprobs[:-1] if row.forced else row.sample_logprobs
        assert max(abs(a - b) for a, b in zip(drawn, ref[: len(drawn)], strict=True)) < 1e-4


def test_the_export_copy_goes_straight_to_host_memory(policy, monkeypatch):
    # deepcopy(model).cpu() first cloned every tensor on its device (twice a GPU worker's model); the copy must
    # never deep-copy a tensor where it lives, must not share memory with the live model (int8 quantises in
    # place), and keeps tied weights tied.
    def no_device_clone(self, memo):
        raise AssertionError("a tensor was deep-copied on its own device")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", no_device_clone)
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", no_device_clone)
    model = policy.model
    copied = cpu_copy(model)
    monkeypatch.undo()
    live, new = dict(model.named_parameters()), dict(copied.named_parameters())
    assert live.keys() == new.keys() and all(torch.equal(live[k], new[k]) for k in live)
    assert all(live[k].data_ptr() != new[k].data_ptr() for k in live)
    assert copied.get_input_embeddings().weight is copied.get_output_embeddings().weight
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


def test_an_export_given_where_a_model_is_read_says_it_is_one_and_how_to_use_it(export_f32):
    """`rlt2t eval --checkpoint <export>` read CTranslate2's config.json as a model's: `model_type None is not…`."""
    from rlt2t.common.family_table import family_of_dir

    with pytest.raises(ValueError, match=rf"{re.escape(str(export_f32))}: a CTranslate2 export, which torch cannot "
                                         rf"load: predict or score with it \(rlt2t predict --generators "
                                         rf"{re.escape(str(export_f32))} "):
        family_of_dir(export_f32)
