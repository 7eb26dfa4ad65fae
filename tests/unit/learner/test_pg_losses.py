"""The policy-gradient primitives of rlt2t.learner.losses against hand computations and plain-Python loop
references written from docs/design.md's definitions."""

from __future__ import annotations

import math

import pytest
import torch

from rlt2t.learner.losses import (
    AdaptiveKLController,
    baseline_advantages,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    gold_cross_entropy,
    kl_estimate,
    leave_one_out_advantages,
    mask_leak,
    masked_mean,
    masked_whiten,
    normalised_advantages,
)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor(d))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([x * x / 2 for x in d]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([math.exp(-x) + x - 1 for x in d]))
    # k3 is never negative, even where k1 is
    many = kl_estimate(torch.randn(1000), torch.randn(1000), "k3")
    assert bool((many >= 0).all())
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_estimators_are_unbiased_for_the_true_kl():
    """Sampling y ~ p, the means of k1 and k3 approach KL(p || q) (k2 only approximately)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    true_kl = float((p * (p / q).log()).sum())
    y = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[y], q.log()[y]
    for kind in ("k1", "k3"):
        assert abs(float(kl_estimate(logp, logq, kind).mean()) - true_kl) < 0.01


def test_sequence_advantages_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])
    torch.testing.assert_close(baseline_advantages(r, torch.tensor([2.0, 1.0])),
                               torch.tensor([[-1.0, 0.0, 1.0], [-0.5, -0.5, -0.5]]))
    # RLOO: r_k - mean of the others
    torch.testing.assert_close(leave_one_out_advantages(r),
                               torch.tensor([[1 - 2.5, 2 - 2.0, 3 - 1.5], [0.0, 0.0, 0.0]]))
    # GRPO: (r - mean) / (std_ddof1 + 1e-4); std of [1, 2, 3] with ddof 1 is 1; a tied group gives 0
    torch.testing.assert_close(normalised_advantages(r),
                               torch.tensor([[-1 / 1.0001, 0.0, 1 / 1.0001], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="baseline"):
        baseline_advantages(r, None)
    with pytest.raises(ValueError, match="K >= 2"):
        leave_one_out_advantages(r[:, :1])


def test_grpo_scales_by_hand():
    # Two sources: one whose rewards differ by a hair, one whose rewards differ by 2.
    r = torch.tensor([[0.00, 0.03, 0.00], [1.0, 3.0, 2.0]], dtype=torch.float64)
    centred = torch.tensor([[-0.01, 0.02, -0.01], [-1.0, 1.0, 0.0]], dtype=torch.float64)
    # group: each source divided by its own std (ddof 1): the hair-thin group gets advantages as large as the other
    group = normalised_advantages(r)
    torch.testing.assert_close(group[0], centred[0] / (0.03 / 3**0.5 + 1e-4))
    torch.testing.assert_close(group[1], centred[1] / (1.0 + 1e-4))
    # batch: one std (ddof 0) of all six deviations, so the sources keep their relative sizes
    rms = (sum(float(x) ** 2 for x in centred.flatten()) / 6) ** 0.5
    torch.testing.assert_close(normalised_advantages(r, scale="batch"), centred / (rms + 1e-4))
    torch.testing.assert_close(normalised_advantages(r, scale="none"), centred)
    with pytest.raises(ValueError, match="scale"):
        normalised_advantages(r, scale="rank")  # type: ignore[arg-type]


def test_grpo_batch_scale_spans_the_ranks():
    # Two learner ranks holding a source each: all_sum adds the other rank's sums, and each rank's advantages are
    # what one rank holding both sources computes.
    r = torch.tensor([[0.00, 0.03, 0.00], [1.0, 3.0, 2.0]], dtype=torch.float64)
    whole = normalised_advantages(r, scale="batch")
    shards = [r[:1], r[1:]]

    def sums(x):
        c = (x - x.mean(dim=1, keepdim=True)).double()
        return torch.stack([(c**2).sum(), torch.tensor(float(c.numel()), dtype=torch.float64)])

    for i, shard in enumerate(shards):
        other = sums(shards[1 - i])
        got = normalised_advantages(shard, scale="batch", all_sum=lambda t, other=other: t + other)
        torch.testing.assert_close(got, whole[i : i + 1])
    # without the other rank's sums, a rank's scale is its own
    assert not torch.allclose(normalised_advantages(shards[0], scale="batch"), whole[:1])


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        n = sum(mask[b])
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[adv[b][t] + values[b][t] if mask[b][t] else 0.0 for t in range(len(rewards[b]))]
           for b in range(len(rewards))]
    return adv, ret


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_matches_the_loop_reference(gamma, lam):
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv))
    torch.testing.assert_close(ret, torch.tensor(ref_ret))


def test_gae_single_reward_at_the_end_by_hand():
    # r = [0, 0, 1], V = [0.5, 0.5, 0.5], gamma = lam = 1: A_t = 1 - V_t (Monte-Carlo return minus value)
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.ones(1, 3))


def test_clipped_policy_loss_by_hand():
    # per token max(-rho * A, -clip(rho) * A): rho 1.5, A +1 -> max(-1.5, -1.2) = -1.2 (clipped);
    # rho 0.5, A +1 -> max(-0.5, -0.8) = -0.5; rho 1.5, A -1 -> max(1.5, 1.2) = 1.5; the 4th is padding
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 7.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2)
    expected = (max(-1.5, -1.2) + max(-0.5, -0.8) + max(1.5, 1.2)) / 3
    assert loss.item() == pytest.approx(expected)
    assert stats["clip_fraction"].item() == pytest.approx(1.0)  # all three ratios are outside [0.8, 1.2]
    loss.backward()
    # gradient only where the unclipped term is active (tokens 2 and 3), zero at the clipped one and padding
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1] == pytest.approx(-0.5 / 3) and logp.grad[0, 2] == pytest.approx(1.5 / 3)


def test_on_policy_ratio_one_gives_the_plain_policy_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    adv = torch.tensor([2.0, -1.0])  # sequence advantages broadcast over tokens
    mask = torch.ones(2, 3)
    loss, stats = clipped_policy_loss(logp, logp.detach(), adv, mask, 0.2)
    assert stats["ratio_mean"].item() == pytest.approx(1.0) and stats["approx_kl"].item() == pytest.approx(0.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv.unsqueeze(1).expand(2, 3) / 6)


def test_importance_weights_scale_each_token_and_a_dropped_token_is_safe():
    logp = torch.tensor([[0.0, float("-inf")]], requires_grad=True)  # a token outside the new top-k
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), 0.2,
                                  weights=torch.tensor([[0.5, 2.0]]))
    # token 0: ratio 1 -> -1 * 0.5; token 1: ratio 0 -> max(0, -0.8) = 0 ... times 2
    assert loss.item() == pytest.approx((-0.5 + 0.0) / 2)
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    ret = torch.tensor([[2.0, 1.0, 9.0]])
    loss, frac = clipped_value_loss(values, old, ret, torch.tensor([[1, 1, 0]]), clip_eps=0.2)
    # token 0: V = 1 (moved 0.5 > 0.2) -> clipped 0.7; max((1-2)^2, (0.7-2)^2) = 1.69; token 1: (0-1)^2 = 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert frac.item() == pytest.approx(0.5)


def test_masked_mean_and_whiten():
    v = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(v, m).item() == pytest.approx(11 / 4)
    w = masked_whiten(v, m)
    picked = w[m.bool()]
    assert picked.mean().abs().item() < 1e-6 and picked.var(unbiased=False).item() == pytest.approx(1.0, rel=1e-5)
    assert w[0, 2] == 0 and w[1, 1] == 0
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0


def test_adaptive_kl_controller_by_hand():
    c = AdaptiveKLController(0.1, target=6.0, horizon=100)
    # kl 12 -> error clipped at 0.2; n = 10 -> coef * (1 + 0.02)
    assert c.update(12.0, 10) == pytest.approx(0.1 * 1.02)
    # kl 5.4 -> error -0.1 -> * (1 - 0.01)
    assert c.update(5.4, 10) == pytest.approx(0.1 * 1.02 * 0.99)
    state = c.state_dict()
    d = AdaptiveKLController(0.5, target=1.0, horizon=1)
    d.load_state_dict(state)
    assert d.coef == c.coef and d.target == 6.0
    fixed = AdaptiveKLController(0.3, target=None, horizon=10)
    assert fixed.update(100.0, 64) == 0.3
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_mask_leak_by_hand():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    logits = probs.log() + 7.0  # a shift changes nothing
    allowed = torch.tensor([[True, False, True, False], [True, True, True, True]])
    torch.testing.assert_close(mask_leak(logits, allowed), torch.tensor([-math.log(0.4), 0.0]))
    # KL(q || p) with q = p restricted to the allowed tokens and renormalised, computed the long way
    q = torch.where(allowed[0], probs[0], 0.0) / 0.4
    kl = sum(float(q[v] * (q[v] / probs[0, v]).log()) for v in range(4) if allowed[0, v])
    assert mask_leak(logits, allowed)[0].item() == pytest.approx(kl)
    with pytest.raises(ValueError, match="one shape"):
        mask_leak(logits, allowed[:, :3])


def test_gold_cross_entropy_is_the_mean_over_real_tokens_by_hand():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.tensor([[1, 4, -100], [0, -100, -100]])
    logp = logits.log_softmax(-1)
    by_hand = -(logp[0, 0, 1] + logp[0, 1, 4] + logp[1, 0, 0]) / 3  # padding counts for nothing
    assert float(gold_cross_entropy(logits, labels)) == pytest.approx(float(by_hand), rel=1e-6)
