"""The policy-gradient learner's shared-encoder forward for K rows against K full passes."""

from __future__ import annotations

import copy

import torch

from rlt2t.common.collate import IGNORE_INDEX
from rlt2t.learner.group_step import GroupPolicy, ValueHead, group_forward, naive_group_forward
from rlt2t.learner.losses import clipped_policy_loss, masked_mean


def _batch(vocab: int, size: int = 3, k: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, vocab, (size, 7), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0  # a padded source
    labels = torch.randint(4, vocab, (k * size, 6), generator=g)
    labels[2, 3:] = IGNORE_INDEX  # a short sample
    labels[5, 1:] = IGNORE_INDEX
    return input_ids, attention_mask, labels


def _loss(out, labels):
    valid = labels != IGNORE_INDEX
    logp = out.logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    adv = torch.linspace(-1, 1, labels.shape[0])
    loss, _ = clipped_policy_loss(logp, logp.detach() - 0.1, adv, valid, 0.2)
    if out.values is not None:
        loss = loss + masked_mean(out.values**2, valid)
    return loss


def test_shared_encoder_equals_k_full_passes_in_loss_and_gradients(tiny_policy):
    model = tiny_policy.model.eval()
    k = 4
    input_ids, attention_mask, labels = _batch(model.config.vocab_size, k=k)
    head = ValueHead(model.config.d_model)
    with torch.no_grad():
        head.linear.weight.normal_(0, 0.5)  # a non-zero head, so its gradient path is checked too
    twin, twin_head = copy.deepcopy(model), copy.deepcopy(head)
    shared = group_forward(model, input_ids, attention_mask, labels, k, head)
    naive = naive_group_forward(twin, input_ids, attention_mask, labels, k, twin_head)
    valid = labels != IGNORE_INDEX
    torch.testing.assert_close(shared.logits[valid], naive.logits[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared.values[valid], naive.values[valid], atol=1e-5, rtol=1e-5)
    a, b = _loss(shared, labels), _loss(naive, labels)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    a.backward()
    b.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(head.linear.weight.grad, twin_head.linear.weight.grad, atol=1e-5, rtol=1e-4)


def test_rows_are_rep_major_and_the_module_wraps_the_same_forward(tiny_policy):
    model = tiny_policy.model.eval()
    input_ids, attention_mask, labels = _batch(model.config.vocab_size, size=2, k=3)
    out = GroupPolicy(model)(input_ids, attention_mask, labels, 3)
    # row j*B + i is sample j of source i: row 3 (j=1, i=1) against a one-source pass of source 1
    alone = model(input_ids=input_ids[1:2], attention_mask=attention_mask[1:2], labels=labels[3:4]).logits
    torch.testing.assert_close(out.logits[3:4], alone, atol=1e-5, rtol=1e-5)
    assert out.values is None
