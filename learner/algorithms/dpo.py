"""DPO and IPO: offline preference optimisation for encoder–decoders (Rafailov et al. 2023; Azar et al. 2024).

The whole algorithm is this module: its settings (``rl.dpo.*``), its unit and its objective. The pairs come from
the offline preference job (``rlt2t.offline``): preference files, or samples of the start ordered by the reward.
Nothing here imports torch at import time (a config names the unit and validates without it); the objective's
methods import it when a learner runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from rlt2t.common.algorithms import Algorithm, PreferenceSettings

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from rlt2t.common.config import Config, RLConfig, RolloutConfig
    from rlt2t.common.policy import Policy
    from rlt2t.common.types import PreferencePair


class DPOSettings(PreferenceSettings):
    """`rl.dpo`: the preference loss and where its pairs come from."""

    beta: float = Field(0.1, gt=0.0)
    """β: how strongly the policy is held to the reference (the SFT checkpoint). Sigmoid loss: the implicit
    reward's scale; IPO: the margin 1/(2β) the log-ratio difference is pulled to."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid`: DPO, −log σ(β·h); `ipo`: IPO, (h − 1/(2β))², which does not drive h to infinity on
    deterministic preferences. h = (log π(chosen) − log π_ref(chosen)) − (log π(rejected) − log π_ref(rejected)),
    sequence log-probs summed over the target tokens."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """Sigmoid loss only: the assumed probability that a pair's label is flipped (conservative DPO); 0: off."""


@dataclass(frozen=True, eq=False)
class PreferenceBatch:
    """B pairs: the sources once, the chosen then the rejected targets as 2·B label rows (rep-major, the layout
    of ``rlt2t.learner.group_step``: row i chosen of pair i, row B + i its rejected), -100 padding."""

    input_ids: Tensor
    """[B, S]"""
    attention_mask: Tensor
    """[B, S]"""
    labels: Tensor
    """[2B, T]"""
    weights: Tensor
    """[B] each pair's weight in the loss."""

    def to(self, device: torch.device | str) -> PreferenceBatch:
        return PreferenceBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class DPO(Algorithm):
    """Direct preference optimisation, offline: from pairs (chosen, rejected) of a source, raise the policy's
    log-probability ratio to the frozen reference (the start, the SFT checkpoint; under LoRA the base with the
    adapters disabled) on the chosen target over the rejected one. `rl.dpo.loss=ipo` gives IPO. The pairs come
    from preference files (`rl.dpo.rank_lists`, `pairs`, `ratings`: the annotation app's export, rank-list TSVs)
    or, with none, from `rl.dpo.sampled_candidates` samples per training source ordered by the reward (best vs
    worst). No rollouts while it trains: the learner scores chosen and rejected with one encoder pass, and the
    reference likewise; dropout is off. `rl.batch_size` counts pairs; `rl.epochs` passes over them."""

    name = "dpo"
    data = "preferences"
    settings = DPOSettings
    uses_reference = False  # the KL of rl.kl.* does not apply: the reference enters through the loss itself
    learner_reference = True
    default_refresh_steps = 0
    default_lr = 2e-5  # at the policy gradients' 2e-4 it drifted 6-31 nats from the start (bench/findings/dpo_synth.md)

    def check(self, cfg: Config) -> None:
        if cfg.rl.pg.sft_coef:
            raise ValueError("rl.pg.sft_coef: DPO's loss has no likelihood term (leave rl.pg.sft_coef at 0)")

    def objective(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, *, seed: int,
                  reference: Any = None) -> DPOObjective:
        return DPOObjective(rl.section(self.name), policy, reference=reference)


def preference_loss(h: Tensor, settings: DPOSettings) -> Tensor:
    """The per-pair loss [B] from the log-ratio differences h [B] (see ``DPOSettings.loss``)."""
    import torch.nn.functional as F

    beta = settings.beta
    if settings.loss == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    eps = settings.label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


class DPOObjective:
    """What a learner rank optimises for DPO / IPO (the learner's objective protocol)."""

    metric_keys = ("loss", "reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected", "logp_chosen",
                   "logp_rejected", "grad_norm")

    def __init__(self, settings: DPOSettings, policy: Policy, *, reference: nn.Module | None = None) -> None:
        import copy

        from rlt2t.common.lora import is_lora
        from rlt2t.learner.group_step import GroupPolicy
        from rlt2t.learner.objectives import frozen_reference

        self.settings, self.policy = settings, policy
        if reference is None and not is_lora(policy.model):
            # The learner built the policy from the start checkpoint and hands no reference: copy it now.
            reference = copy.deepcopy(policy.model)
        self.reference = frozen_reference(reference)
        self.module = GroupPolicy(policy.model)
        self.module.eval()  # dropout off: the policy and the reference score alike at the start (h = 0)

    def collate(self, items: Sequence[PreferencePair], *, max_source_len: int, max_target_len: int
                ) -> PreferenceBatch:
        import torch

        from rlt2t.common.collate import IGNORE_INDEX, collate_seq2seq, encode_texts, pad

        if not items:
            raise ValueError("a preference batch needs at least one pair")
        tok = self.policy.tokenizer
        sources, _ = encode_texts(tok, [p.source for p in items], max_source_len)
        targets, _ = encode_texts(tok, [p.chosen for p in items] + [p.rejected for p in items], max_target_len,
                                  target=True)
        enc = collate_seq2seq(sources, None, tok.pad_token_id)
        return PreferenceBatch(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                               labels=pad(targets, IGNORE_INDEX),
                               weights=torch.tensor([p.weight for p in items], dtype=torch.float32))

    def preflight_batch(self, sources: int, source_len: int, target_len: int, generator: torch.Generator
                        ) -> PreferenceBatch:
        import torch

        vocab = self.policy.model.config.vocab_size
        return PreferenceBatch(
            input_ids=torch.randint(0, vocab, (sources, source_len), generator=generator),
            attention_mask=torch.ones(sources, source_len, dtype=torch.long),
            labels=torch.randint(0, vocab, (2 * sources, target_len), generator=generator),
            weights=torch.ones(sources))

    def preflight(self, run: Any, batch: PreferenceBatch) -> None:
        h, _, _ = self._log_ratios(run, batch)
        preference_loss(h, self.settings).mean().backward()

    def _sequence_logprobs(self, logits: Tensor, labels: Tensor) -> Tensor:
        from rlt2t.common.collate import IGNORE_INDEX
        from rlt2t.common.scoring import token_scores

        return token_scores(logits, labels, "logprobs", IGNORE_INDEX).float().sum(dim=1)

    def _log_ratios(self, run: Any, batch: PreferenceBatch) -> tuple[Tensor, Tensor, Tensor]:
        """(h [B], the policy's sequence log-probs [2B] with gradient, the reference's [2B])."""
        import torch

        from rlt2t.learner.objectives import reference_logits

        size = batch.input_ids.shape[0]
        ref_logits = reference_logits(run, self.module, self.reference, batch.input_ids, batch.attention_mask,
                                      batch.labels, 2)
        with torch.no_grad():
            ref = self._sequence_logprobs(ref_logits, batch.labels)
        out = run.forward(batch.input_ids, batch.attention_mask, batch.labels, 2)
        logp = self._sequence_logprobs(out.logits, batch.labels)
        ratio = logp - ref
        return ratio[:size] - ratio[size:], logp, ref

    def step(self, run: Any, batch: PreferenceBatch, items: Sequence[PreferencePair], step: int
             ) -> dict[str, float]:
        import torch

        from rlt2t.learner.objectives import rank_shares

        del items, step
        size = batch.input_ids.shape[0]
        h, logp, ref = self._log_ratios(run, batch)
        weights = batch.weights.to(h)
        mass = float(weights.sum())
        loss = (preference_loss(h, self.settings) * weights).sum() / max(mass, 1e-12)
        # a weighted mean over every rank's pairs, as one learner would take it
        grad_norm = run.optimize(loss * rank_shares(run, mass)[0])
        with torch.no_grad():
            beta = self.settings.beta
            chosen = beta * (logp[:size] - ref[:size])
            rejected = beta * (logp[size:] - ref[size:])
            return {"loss": float(loss), "reward_margin": float((chosen - rejected).mean()),
                    "reward_accuracy": float((h > 0).float().mean()), "reward_chosen": float(chosen.mean()),
                    "reward_rejected": float(rejected.mean()), "logp_chosen": float(logp[:size].mean()),
                    "logp_rejected": float(logp[size:].mean()), "grad_norm": grad_norm}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    def frozen_modules(self) -> list[nn.Module]:
        return [] if self.reference is None else [self.reference]
