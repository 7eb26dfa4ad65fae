"""Pieces of the feedback loop: the scripted annotator, the token it prefers, and the KL estimate against a
hand computation (on every decoder-start convention: mBART starts from a language code, not a shifted label)."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.candidates import stable_seed
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.policy import load_policy
from rlt2t.common.sampling import sample_candidates
from rlt2t.feedback import ScriptedAnnotator, choose_token, preference_stats, sample_and_kl


def test_scripted_annotator_ranks_distinct_scores_best_first():
    a = ScriptedAnnotator("7")
    assert a.rank(["1 2", "7 3", "7 7", "4 7", "9"]) == ["7 7", "7 3", "1 2"]  # one per score, first seen
    assert a.rank(["1 2", "3"]) is None  # nothing to tell apart
    assert preference_stats([["7 7", "1"], ["7 2", "3 4 5"]], a) == {"preference": 0.75, "hit_rate": 0.5,
                                                                     "mean_length": 2.0}


def test_choose_token_takes_the_one_nearest_a_quarter():
    lists = [["1 2 3", "1 2", "1 4"], ["1 5", "6 2", "1"], ["2 9", "1 8", "7"], ["1", "3", "1 2"]]
    # presence over 12 candidates: "1" 8/12, "2" 5/12, "3" 2/12 ... "2" is at 0.417, "3" at 0.167: "3" is nearer 0.25
    assert choose_token(lists) == "3"
    with pytest.raises(ValueError):
        choose_token([[""]])


def test_kl_is_zero_against_itself_and_matches_a_hand_computation(ids_tokenizer_dir):
    new = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=1)
    ref = load_policy(ModelConfig(preset="tiny", family="bart", dropout=0.0), ids_tokenizer_dir, seed=2)
    sources = ["1 2 3", "4 5 6 7", "8"]
    texts, same = sample_and_kl(new, new, sources, k=3, max_new_tokens=6, max_source_len=16, seed=0)
    assert same["kl_per_sequence"] == 0.0 and len(texts) == 3 and all(len(t) == 3 for t in texts)
    assert same["tokens_per_sequence"] > 0
    # Two new tokens: the first is drawn, the second (if any) is the forced EOS, which is not counted; so each
    # sequence's KL is exactly KL(new || ref) of the first step's distribution, whatever was sampled.
    _, two = sample_and_kl(new, ref, sources, k=4, max_new_tokens=2, max_source_len=16, seed=0)
    tok = new.tokenizer
    expected = []
    with torch.no_grad():
        for s in sources:
            enc = tok([s], return_tensors="pt")
            start = torch.tensor([[new.model.config.decoder_start_token_id]])
            p = new.model(**enc, decoder_input_ids=start).logits[0, -1].log_softmax(-1)
            q = ref.model(**enc, decoder_input_ids=start).logits[0, -1].log_softmax(-1)
            expected.append(float((p.exp() * (p - q)).sum()))
    assert two["kl_per_sequence"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert two["kl_per_token"] == pytest.approx(two["kl_per_sequence"], rel=1e-5)  # one counted token each


@pytest.mark.parametrize("family", ["mbart", "bart", "t5"])
def test_kl_steps_are_conditioned_on_the_decoder_start_and_the_drawn_prefix(family_dirs, family):
    """Each drawn token's step KL, recomputed one prefix at a time from ``[decoder_start] + y<t``. mBART's
    own shift of ``labels=`` starts a row from its last label instead (a content token where the forced EOS is
    masked), so this failed for mBART while the estimate went through ``labels=``."""
    cfg = ModelConfig(preset=None, dropout=0.0)
    new = load_policy(cfg, checkpoint=family_dirs[family])
    ref = load_policy(cfg, checkpoint=family_dirs[family])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sources, k, limit = ["alpha beta gamma", "red green blue stone river"], 3, 4
    _, kl = sample_and_kl(new, ref, sources, k=k, max_new_tokens=limit, max_source_len=32, seed=5)
    # The same draws (sample_and_kl's seeding), then an independent per-step computation.
    ids, _ = encode_texts(new.tokenizer, sources, 32)
    batch = collate_seq2seq(ids, None, new.tokenizer.pad_token_id)
    generators = [torch.Generator().manual_seed(stable_seed(5, "sample-kl", i, j))
                  for i in range(len(sources)) for j in range(k)]
    rows = sample_candidates(new.model, batch["input_ids"], batch["attention_mask"], k, 0, 1.0, limit, generators)
    start = new.model.config.decoder_start_token_id
    assert family != "mbart" or start == new.tokenizer.convert_tokens_to_ids("en_XX")
    total, counted = 0.0, 0
    with torch.no_grad():
        for n, row in enumerate(rows):
            src = torch.tensor([ids[n // k]])
            for t in range(len(row.token_ids) - row.forced):  # a forced EOS was not drawn
                dec = torch.tensor([[start, *row.token_ids[:t]]])
                p = new.model(input_ids=src, decoder_input_ids=dec).logits[0, -1].float().log_softmax(-1)
                q = ref.model(input_ids=src, decoder_input_ids=dec).logits[0, -1].float().log_softmax(-1)
                total += float((p.exp() * (p - q)).sum())
                counted += 1
    assert counted > len(rows)  # some rows have drawn tokens after the first
    assert kl["tokens_per_sequence"] == pytest.approx(counted / len(rows))
    assert kl["kl_per_sequence"] == pytest.approx(total / len(rows), rel=1e-4, abs=1e-7)


def test_every_rounds_rl_keeps_its_kl_to_the_sft_policy(monkeypatch, tmp_path):
    # Round r starts from round r-1's policy; the KL's reference stays the SFT policy (it bounds the loop's whole
    # drift, as docs/guides/rewards.md says), so rl_job gets both and the job its reference as `init`.
    import rlt2t.driver as train_mod
    import rlt2t.feedback as feedback
    import rlt2t.jobs as jobs
    from rlt2t.common.config import load_config

    sft, previous = tmp_path / "sft" / "epoch-0004", tmp_path / "round-1" / "rl" / "epoch-0002"
    for d in (sft, previous):
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    cfg = load_config(["tiny"], [f"run.dir={tmp_path / 'run'}"])
    calls = {}
    monkeypatch.setattr(jobs, "load_policy", lambda *a, **kw: None)
    monkeypatch.setattr(jobs, "check_lengths", lambda *a: None)
    monkeypatch.setattr(jobs, "load_split", lambda *a, **kw: [])
    monkeypatch.setattr(train_mod, "train", lambda cfg, train_set, valid, **kw: calls.update(kw))
    with pytest.raises(RuntimeError, match="wrote no checkpoint"):  # nothing trained: the fake job writes none
        feedback.rl_step(cfg, tmp_path / "round-2", previous, tmp_path / "rm", reference=sft)
    assert calls["start"] == previous and calls["init"] == sft
