"""Tests for rlt2t.learner.losses: token scores and the delay-weighted pairwise rank loss.

Expected values are written as arithmetic on the hand-chosen inputs (softplus(-d) = -log sigmoid(d)),
or come from the plain Python-loop reference below, which follows docs/design.md's definition step by step.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlt2t.common.scoring import token_scores
from rlt2t.learner.losses import pairwise_rank_loss, rank_weights


def nll_sigmoid(d: float) -> float:
    """-log sigmoid(d), computed by hand."""
    return math.log(1.0 + math.exp(-d))


# --------------------------------------------------------------------------------------------- token_scores


def test_token_scores_logits_picks_label_logit_and_zeroes_padding() -> None:
    logits = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [1.0, -1.0, 2.0, 0.5], [9.0, 9.0, 9.0, 9.0]]])
    labels = torch.tensor([[2, 0, -100]])
    scores = token_scores(logits, labels, kind="logits")
    assert scores.shape == (1, 3)
    torch.testing.assert_close(scores, torch.tensor([[0.3, 1.0, 0.0]]))


def test_token_scores_logprobs_is_log_softmax_of_label() -> None:
    # Row 0: exp-sum = 1 + 1 + 2 = 4, so log p(token 2) = log 2 - log 4 = -log 2.
    # Row 1: uniform over 3 tokens, log p = -log 3.  Row 2 is padding.
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [5.0, 5.0, 5.0], [1.0, 2.0, 3.0]]])
    labels = torch.tensor([[2, 1, -100]])
    scores = token_scores(logits, labels, kind="logprobs")
    torch.testing.assert_close(scores, torch.tensor([[-math.log(2.0), -math.log(3.0), 0.0]]))


def test_token_scores_padding_gets_no_gradient() -> None:
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.tensor([[1, -100, -100], [4, 3, -100]])
    for kind in ("logits", "logprobs"):
        logits.grad = None
        token_scores(logits, labels, kind=kind).sum().backward()
        assert logits.grad is not None
        assert torch.all(logits.grad[labels == -100] == 0)
        assert torch.all(logits.grad[labels != -100].abs().sum(-1) > 0)


def test_token_scores_upcasts_low_precision_logits() -> None:
    logits = torch.randn(1, 2, 4).to(torch.bfloat16)
    scores = token_scores(logits, torch.tensor([[1, 2]]), kind="logprobs")
    assert scores.dtype == torch.float32


def test_token_scores_rejects_unknown_kind_and_bad_shapes() -> None:
    logits = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="kind.*'probs'"):
        token_scores(logits, torch.zeros(1, 2, dtype=torch.long), kind="probs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels"):
        token_scores(logits, torch.zeros(1, 3, dtype=torch.long), kind="logits")
    with pytest.raises(ValueError, match="labels"):
        token_scores(logits, torch.zeros(1, 2), kind="logits")


# --------------------------------------------------------------------------------------------- rank weights


def test_rank_weights_start_at_first_difference() -> None:
    labels_a = torch.tensor([[5, 7, 8, 2], [3, 4, 2, -100], [5, 6, 2, -100], [1, 2, 3, 4]])
    labels_b = torch.tensor([[5, 9, 2, -100], [6, 4, 2, -100], [5, 6, 7, 2], [1, 2, 3, 4]])
    expected = torch.tensor(
        [
            [0.0, 1.0, 0.5, 0.25],  # differ at t=1
            [1.0, 0.5, 0.25, 0.125],  # differ at t=0
            [0.0, 0.0, 1.0, 0.5],  # padding (-100) against a real token counts as a difference at t=2
            [0.0, 0.0, 0.0, 0.0],  # identical: s = T
        ]
    )
    torch.testing.assert_close(rank_weights(labels_a, labels_b, alpha=0.5), expected)
    # alpha = 0 keeps only the first differing step (0^0 = 1).
    torch.testing.assert_close(rank_weights(labels_a, labels_b, alpha=0.0), (expected == 1.0).float())


# ------------------------------------------------------------------------------------ pairwise_rank_loss


def hand_batch() -> dict[str, torch.Tensor]:
    """B=2, T=4. Pair 0 first differs at t=1 (b padded at t=3), pair 1 at t=0 (both padded at t=3)."""
    return {
        "scores_a": torch.tensor([[0.3, 1.0, -0.5, 2.0], [-1.0, 0.4, 0.1, 0.0]], dtype=torch.float64),
        "scores_b": torch.tensor([[0.3, 0.2, 0.5, 0.0], [-0.5, 0.6, 0.1, 0.0]], dtype=torch.float64),
        "labels_a": torch.tensor([[5, 7, 8, 2], [3, 4, 2, -100]]),
        "labels_b": torch.tensor([[5, 9, 2, -100], [6, 4, 2, -100]]),
    }


# alpha = 0.5. Pair 0: w = (0, 1, 0.5, [0.25 excluded: b is padding]); d_1 = 1.0 - 0.2, d_2 = -0.5 - 0.5.
PAIR0_NUM = 1.0 * nll_sigmoid(1.0 - 0.2) + 0.5 * nll_sigmoid(-0.5 - 0.5)
PAIR0_DEN = 1.0 + 0.5
# Pair 1: w = (1, 0.5, 0.25, [excluded]); d_0 = -1.0 + 0.5, d_1 = 0.4 - 0.6, d_2 = 0.
PAIR1_NUM = 1.0 * nll_sigmoid(-1.0 + 0.5) + 0.5 * nll_sigmoid(0.4 - 0.6) + 0.25 * nll_sigmoid(0.0)
PAIR1_DEN = 1.0 + 0.5 + 0.25
# Weighted score sums: pair 0 a = 1.0 - 0.25 = 0.75 > b = 0.2 + 0.25 = 0.45 (correct);
# pair 1 a = -1.0 + 0.2 + 0.025 = -0.775 < b = -0.5 + 0.3 + 0.025 = -0.175 (wrong).


def test_pairwise_rank_loss_matches_hand_computation() -> None:
    batch = hand_batch()
    loss, accuracy = pairwise_rank_loss(**batch, use_rank=torch.tensor([1, 1]), alpha=0.5)
    expected = (PAIR0_NUM + PAIR1_NUM) / (PAIR0_DEN + PAIR1_DEN + 1e-8)
    assert loss.dim() == 0 and accuracy.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert accuracy.item() == pytest.approx(0.5)


def test_use_rank_zero_pair_is_excluded() -> None:
    batch = hand_batch()
    loss, accuracy = pairwise_rank_loss(**batch, use_rank=torch.tensor([True, False]), alpha=0.5)
    assert loss.item() == pytest.approx(PAIR0_NUM / (PAIR0_DEN + 1e-8), rel=1e-12)
    assert accuracy.item() == pytest.approx(1.0)  # only pair 0 counts, and it is ranked correctly
    loss, accuracy = pairwise_rank_loss(**batch, use_rank=torch.tensor([0, 1]), alpha=0.5)
    assert loss.item() == pytest.approx(PAIR1_NUM / (PAIR1_DEN + 1e-8), rel=1e-12)
    assert accuracy.item() == pytest.approx(0.0)


def test_identical_labels_contribute_nothing() -> None:
    batch = hand_batch()
    same = torch.tensor([[4, 4, 9, 2]])
    extra_a = torch.tensor([[3.0, -2.0, 1.0, 0.5]], dtype=torch.float64)
    extra_b = torch.tensor([[-3.0, 2.0, 0.0, 1.5]], dtype=torch.float64)
    extended = {
        "scores_a": torch.cat([batch["scores_a"], extra_a]),
        "scores_b": torch.cat([batch["scores_b"], extra_b]),
        "labels_a": torch.cat([batch["labels_a"], same]),
        "labels_b": torch.cat([batch["labels_b"], same]),
    }
    loss3, acc3 = pairwise_rank_loss(**extended, use_rank=torch.tensor([1, 1, 1]), alpha=0.5)
    loss2, acc2 = pairwise_rank_loss(**batch, use_rank=torch.tensor([1, 1]), alpha=0.5)
    assert loss3.item() == pytest.approx(loss2.item(), rel=1e-12)
    assert acc3.item() == pytest.approx(acc2.item())  # the identical pair is not counted in accuracy either


def test_nothing_counted_gives_exact_zero_and_a_gradient() -> None:
    batch = hand_batch()
    scores_a = batch["scores_a"].clone().requires_grad_(True)
    loss, accuracy = pairwise_rank_loss(
        scores_a, batch["scores_b"], batch["labels_a"], batch["labels_b"], torch.tensor([0, 0]), alpha=0.5
    )
    assert loss.item() == 0.0 and accuracy.item() == 0.0
    loss.backward()
    assert scores_a.grad is not None
    assert torch.equal(scores_a.grad, torch.zeros_like(scores_a))


def test_infinite_score_at_excluded_step_does_not_poison_the_loss() -> None:
    batch = hand_batch()
    scores_b = batch["scores_b"].clone()
    scores_b[0, 3] = float("inf")  # pair 0, t=3 is excluded (b is padding there)
    scores_a = batch["scores_a"].clone().requires_grad_(True)
    loss, _ = pairwise_rank_loss(
        scores_a, scores_b, batch["labels_a"], batch["labels_b"], torch.tensor([1, 1]), alpha=0.5
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(scores_a.grad).all()


def test_gradient_sign_raising_a_lowers_the_loss() -> None:
    batch = hand_batch()
    scores_a = batch["scores_a"].clone().requires_grad_(True)
    scores_b = batch["scores_b"].clone().requires_grad_(True)
    use_rank = torch.tensor([1, 1])
    labels_a, labels_b = batch["labels_a"], batch["labels_b"]
    loss, _ = pairwise_rank_loss(scores_a, scores_b, labels_a, labels_b, use_rank, alpha=0.5)
    loss.backward()
    counted = torch.tensor([[False, True, True, False], [True, True, True, False]])
    assert torch.all(scores_a.grad[counted] < 0) and torch.all(scores_b.grad[counted] > 0)
    assert torch.all(scores_a.grad[~counted] == 0) and torch.all(scores_b.grad[~counted] == 0)

    raised = batch["scores_a"] + 0.1 * counted
    loss_raised, _ = pairwise_rank_loss(raised, batch["scores_b"], labels_a, labels_b, use_rank, alpha=0.5)
    assert loss_raised.item() < loss.item()


def test_low_precision_scores_give_float32_loss() -> None:
    batch = hand_batch()
    loss, accuracy = pairwise_rank_loss(
        batch["scores_a"].bfloat16(), batch["scores_b"].bfloat16(), batch["labels_a"], batch["labels_b"],
        torch.tensor([1, 1]), alpha=0.5,
    )
    assert loss.dtype == torch.float32 and accuracy.dtype == torch.float32


def reference_rank_loss(
    scores_a: torch.Tensor,
    scores_b: torch.Tensor,
    labels_a: torch.Tensor,
    labels_b: torch.Tensor,
    use_rank: torch.Tensor,
    alpha: float,
) -> tuple[float, float]:
    """docs/design.md's rank loss written as plain Python loops over pairs and steps."""
    za, zb, la, lb = scores_a.tolist(), scores_b.tolist(), labels_a.tolist(), labels_b.tolist()
    numerator = denominator = 0.0
    correct = pairs = 0
    for i in range(len(la)):
        length = len(la[i])
        start = next((t for t in range(length) if la[i][t] != lb[i][t]), length)
        sum_a = sum_b = 0.0
        any_counted = False
        for t in range(start, length):
            weight = alpha ** (t - start)
            if not use_rank[i] or la[i][t] == -100 or lb[i][t] == -100 or weight <= 1e-8:
                continue
            any_counted = True
            numerator += weight * nll_sigmoid(za[i][t] - zb[i][t])
            denominator += weight
            sum_a += weight * za[i][t]
            sum_b += weight * zb[i][t]
        if any_counted:
            pairs += 1
            correct += sum_a > sum_b
    return numerator / (denominator + 1e-8), (correct / pairs if pairs else 0.0)


@pytest.mark.parametrize("alpha", [0.95, 0.5, 0.02])
def test_vectorised_matches_python_loop_reference(alpha: float) -> None:
    generator = torch.Generator().manual_seed(1234)
    size, length = 16, 12
    # A 3-token vocabulary makes shared prefixes (late first differences) common.
    labels_a = torch.randint(3, 6, (size, length), generator=generator)
    labels_b = torch.randint(3, 6, (size, length), generator=generator)
    share = torch.randint(0, length + 1, (size,), generator=generator)
    steps = torch.arange(length)
    labels_b = torch.where(steps < share[:, None], labels_a, labels_b)
    for labels in (labels_a, labels_b):
        lengths = torch.randint(1, length + 1, (size,), generator=generator)
        labels.masked_fill_(steps >= lengths[:, None], -100)
    labels_b[:2] = labels_a[:2]  # two identical pairs
    use_rank = torch.rand(size, generator=generator) < 0.8
    scores_a = torch.randn(size, length, generator=generator, dtype=torch.float64)
    scores_b = torch.randn(size, length, generator=generator, dtype=torch.float64)

    loss, accuracy = pairwise_rank_loss(scores_a, scores_b, labels_a, labels_b, use_rank, alpha=alpha)
    expected_loss, expected_accuracy = reference_rank_loss(
        scores_a, scores_b, labels_a, labels_b, use_rank, alpha
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-10)
    assert accuracy.item() == pytest.approx(expected_accuracy, abs=1e-12)
    assert expected_loss > 0.0 and 0.0 < expected_accuracy < 1.0  # the random batch exercises both branches


def test_pairwise_rank_loss_rejects_bad_inputs() -> None:
    batch = hand_batch()
    with pytest.raises(ValueError, match="use_rank"):
        pairwise_rank_loss(**batch, use_rank=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="alpha"):
        pairwise_rank_loss(**batch, use_rank=torch.tensor([1, 1]), alpha=1.5)
    with pytest.raises(ValueError, match="labels_b"):
        pairwise_rank_loss(**{**batch, "labels_b": batch["labels_b"][:, :3]}, use_rank=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="labels_a"):
        pairwise_rank_loss(**{**batch, "labels_a": batch["labels_a"].double()}, use_rank=torch.tensor([1, 1]))
