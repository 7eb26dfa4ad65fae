"""The shared-encoder rank step on every encoder-decoder family: loss AND gradients equal the naive three full
passes (BART-style encoder_attn, T5's EncDecAttention with relative position bias, a BERT decoder's
crossattention; learned, sinusoidal and relative positions; tied and untied output embeddings), and the
cross-attention keys/values really are computed once per layer."""

from __future__ import annotations

import pytest
import torch

from rlt2t.common.collate import IGNORE_INDEX, collate_seq2seq, encode_texts, pad
from rlt2t.common.config import ModelConfig
from rlt2t.common.families import cross_attentions
from rlt2t.common.policy import load_policy
from rlt2t.learner.rank_step import RankBatch, naive_rank_loss, shared_encoder_rank_loss

FAMILIES = ("bart", "t5", "t5-v1.0", "marian", "mbart", "pegasus", "encoder-decoder")
SOURCES = ["alpha beta gamma delta epsilon", "river stone", "quick slow red green blue small", "mu nu"]
GOLD = ["alpha beta", "stone river stone", "red", "xi omicron pi rho sigma"]
A = ["alpha gamma", "stone", "red green", "xi pi"]
B = ["alpha beta gamma", "stone river", "red green", "tau"]  # pair 2 identical: use_rank 0


def rank_batch(tok) -> RankBatch:
    src, _ = encode_texts(tok, SOURCES, 64)
    gold, _ = encode_texts(tok, GOLD, 64)
    both, _ = encode_texts(tok, A + B, 64)
    seq = collate_seq2seq(src, gold, tok.pad_token_id)
    labels_a, labels_b = pad(both, IGNORE_INDEX).split(len(A))
    return RankBatch(seq["input_ids"], seq["attention_mask"], seq["labels"], labels_a, labels_b,
                     torch.tensor([a != b for a, b in zip(A, B, strict=True)]))


def loss_and_grads(model, fn, batch):
    model.zero_grad(set_to_none=True)
    out = fn(model, batch, score_kind="logprobs", loss_weight=0.5, alpha=0.9)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("name", FAMILIES)
def test_shared_step_equals_naive_passes(name, family_dirs):
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs[name]), dropout=0.0))
    model = policy.model.train()  # dropout 0: train mode, so gradients flow as in the learner
    model.float()
    batch = rank_batch(policy.tokenizer)
    # candidates padded to another length than the gold: the shared step cannot assume one decoder length
    assert batch.labels_a.shape[1] != batch.gold_labels.shape[1]

    calls = {"n": 0}
    hooks = [a.key.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
             for a in cross_attentions(model)]
    shared, g_shared = loss_and_grads(model, shared_encoder_rank_loss, batch)
    assert calls["n"] == len(hooks)  # one key projection per layer: the decoder read the shared cache
    naive, g_naive = loss_and_grads(model, naive_rank_loss, batch)
    for h in hooks:
        h.remove()

    for field in ("loss", "ce", "rank", "accuracy"):
        torch.testing.assert_close(getattr(shared, field), getattr(naive, field), rtol=1e-5, atol=1e-6)
    assert shared.rank > 0
    assert g_shared.keys() == g_naive.keys()
    for key in g_naive:
        torch.testing.assert_close(g_shared[key], g_naive[key], rtol=1e-4, atol=1e-6, msg=key)
    # Every layer's cross-attention key and value projections get gradients through the shared cache.
    names = {id(p): n for n, p in model.named_parameters()}
    for a in cross_attentions(model):
        for proj in (a.key, a.value):
            name = names[id(proj.weight)]
            assert name in g_shared and g_shared[name].abs().sum() > 0, name


def test_naive_ce_is_huggingface_loss(family_dirs):
    # The reference itself: on a family whose HF shift is the plain one, its CE is HF's own loss.
    policy = load_policy(ModelConfig(preset=None, path=str(family_dirs["t5"]), dropout=0.0))
    batch = rank_batch(policy.tokenizer)
    hf = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.gold_labels).loss
    torch.testing.assert_close(naive_rank_loss(policy.model, batch).ce, hf)
