"""TRPO: trust region policy optimisation (Schulman et al. 2015), token level, with PPO's value head and GAE.

The whole algorithm is this module: its settings (``rl.trpo.*``), its unit and its step. The unit is an
actor-critic (``learner/algorithms/base.py``): steps 1 and 2 of the shared ``PolicyGradientObjective`` (the
batch's starting policy, the KL-shaped token rewards, GAE, whitening) are PPO's; step 3, the optimisation, is a
natural-gradient step under a KL trust region instead of optimizer steps (docs/design.md, "Policy-gradient
algorithms"). Nothing here imports torch at import time (a config names the unit and validates without it).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from rlt2t.learner.algorithms.base import ActorCritic

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from torch import Tensor

    from rlt2t.common.config import Config, RLConfig, RolloutConfig

log = logging.getLogger("rlt2t.learner")


class TRPOSettings(BaseModel):
    """`rl.trpo`: the trust region, its conjugate-gradient solve and line search, and the value head's steps."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    max_kl: float = Field(0.01, gt=0.0)
    """δ: the bound on the mean KL(π_old ‖ π) over the batch's sampled tokens (the full next-token distributions
    under the sampler's transform) that a step may reach."""
    cg_iters: int = Field(10, ge=1)
    """Conjugate-gradient iterations solving F·s = g (each one Fisher-vector product: a double backward)."""
    damping: float = Field(0.1, ge=0.0)
    """λ added to the Fisher matrix, F + λ·I: keeps the solve well posed where F is singular (a softmax's is)."""
    line_search_steps: int = Field(10, ge=1)
    """Backtracking steps tried, the maximal step times line_search_ratio^i for i = 0, 1, ..."""
    line_search_ratio: float = Field(0.5, gt=0.0, lt=1.0)
    """The factor each backtracking step shrinks the step by."""
    value_steps: int = Field(5, ge=0)
    """Adam steps of the value head per batch, each on the whole batch (½·token mean of (V − return)²)."""
    value_lr: float = Field(1e-3, gt=0.0)
    """The value head's Adam learning rate (its own optimiser: rl.lr and its schedule do not apply to TRPO)."""


class TRPO(ActorCritic):
    """Trust region policy optimisation, token-level (RL4LMs' fourth on-policy algorithm): PPO's token rewards
    (the reward at the last token, −β·k1 at every token), GAE with a value head on the decoder and whitened
    advantages; then one natural-gradient step per batch that maximises the importance-weighted advantage subject
    to mean KL(π_old ‖ π) ≤ rl.trpo.max_kl over the sampled tokens: the direction from rl.trpo.cg_iters
    conjugate-gradient iterations on Fisher-vector products (damping rl.trpo.damping), the maximal step
    √(2δ / sᵀFs), and a backtracking line search that accepts only an improving surrogate within the bound (a
    warning in the log when it rejects every step; the policy then stays as it was). The value head takes
    rl.trpo.value_steps Adam steps of its own (rl.trpo.value_lr) on the detached decoder states. No learning rate,
    clipping or optimizer steps apply to the policy (rl.lr, rl.pg.clip_eps, epochs, minibatches, target_kl);
    under DDP the gradients and Fisher-vector products are summed over the ranks, so every rank takes the same
    step; under LoRA only the adapters move. Not with rl.pg.sft_coef, rl.pg.entropy_coef or fp16."""

    name = "trpo"
    shardable = False  # it moves the weights itself (line search over flat parameter vectors)
    settings = TRPOSettings
    clipped = False

    def optimisation_epochs(self, rl: RLConfig) -> int:
        return 1

    def optimisation_minibatches(self, rl: RLConfig) -> int:
        return 1

    def check(self, cfg: Config) -> None:
        super().check(cfg)
        for key in ("sft_coef", "entropy_coef"):
            if getattr(cfg.rl.pg, key):
                raise ValueError(f"rl.pg.{key}: TRPO's surrogate has no such term (leave rl.pg.{key} at 0)")
        if cfg.run.mixed_precision == "fp16":
            raise ValueError("run.mixed_precision=fp16: TRPO's double backward runs without loss scaling (use bf16 "
                             "or no mixed precision with rl.algorithm=trpo)")

    def objective(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, *, seed: int,
                  reference: Any = None) -> Any:
        return _objective_class()(rl, rollout, policy, seed=seed, reference=reference, unit=self)


# -- the maths, on flat vectors (pure functions, tested on a policy small enough to form F) ------------------------

def conjugate_gradient(fvp: Callable[[Tensor], Tensor], b: Tensor, iters: int, tol: float = 1e-10) -> Tensor:
    """x ≈ A⁻¹b for the symmetric positive definite A that ``fvp`` multiplies by, after at most ``iters``
    iterations (stopping early once the squared residual is below ``tol``). Deterministic: ranks that hold the same
    ``b`` and products call ``fvp`` equally often."""
    import torch

    x = torch.zeros_like(b)
    r, p = b.clone(), b.clone()
    rr = r @ r
    for _ in range(iters):
        if rr <= tol:
            break
        ap = fvp(p)
        alpha = rr / (p @ ap)
        x += alpha * p
        r -= alpha * ap
        rr_next = r @ r
        p = r + (rr_next / rr) * p
        rr = rr_next
    return x


def token_kl(old_logp: Tensor, logp: Tensor) -> Tensor:
    """KL(old ‖ new) per position [..., ] from full log-prob rows [..., V]; tokens the old distribution excludes
    (−inf, a top-k / top-p transform's) add nothing, a token only the new one excludes makes it inf."""
    import torch

    p_old = old_logp.exp()
    inside = p_old > 0
    return (p_old * torch.where(inside, old_logp - logp, torch.zeros_like(logp))).sum(-1)


def flat_grad(output: Tensor, params: Sequence[torch.nn.Parameter], **kwargs: Any) -> Tensor:
    """d output / d params as one flat vector (zeros where a parameter is not reached)."""
    import torch

    grads = torch.autograd.grad(output, list(params), allow_unused=True, **kwargs)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads,
                                                                                               strict=True)])


def set_flat(params: Sequence[torch.nn.Parameter], flat: Tensor) -> None:
    """Write a flat vector into the parameters (no gradient)."""
    import torch

    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def trust_region_step(params: Sequence[torch.nn.Parameter], g: Tensor, fvp: Callable[[Tensor], Tensor],
                      evaluate: Callable[[], tuple[float, float]], start: float, settings: TRPOSettings
                      ) -> tuple[bool, float, float, float]:
    """One TRPO step of ``params`` from where they are: s ≈ F⁻¹g by conjugate gradient (``fvp`` multiplies by the
    damped Fisher matrix), the maximal step √(2δ / sᵀFs)·s, then the backtracking line search: the first fraction
    ratio^i of it where ``evaluate()`` (the surrogate and the mean KL to the start, at the parameters as they are
    then) gives a surrogate above ``start`` and a KL within δ is kept. Returns (accepted, that fraction, its
    surrogate gain, its KL); rejected, the parameters are put back and the rest are 0."""
    import torch

    if float(g @ g) <= 0:
        return False, 0.0, 0.0, 0.0
    s = conjugate_gradient(fvp, g, settings.cg_iters)
    shs = float(s @ fvp(s))
    if not (shs > 0 and math.isfinite(shs)):
        return False, 0.0, 0.0, 0.0
    full_step = math.sqrt(2 * settings.max_kl / shs) * s
    old = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    for i in range(settings.line_search_steps):
        fraction = settings.line_search_ratio**i
        set_flat(params, old + (fraction * full_step).to(old))
        value, kl = evaluate()
        if kl <= settings.max_kl and value > start:
            return True, fraction, value - start, kl
    set_flat(params, old)
    return False, 0.0, 0.0, 0.0


@functools.cache
def _objective_class() -> type:
    """The objective, a ``PolicyGradientObjective`` whose step 3 is TRPO's (built at first use: the shared
    objective's module imports torch)."""
    import copy

    import torch
    from torch import nn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlt2t.common.collate import IGNORE_INDEX
    from rlt2t.common.sampling import warp_logits
    from rlt2t.learner.batch import GroupBatch
    from rlt2t.learner.group_step import ValueHead, group_forward
    from rlt2t.learner.losses import clipped_policy_loss, masked_mean
    from rlt2t.learner.objectives import Experience, PolicyGradientObjective, StepRunner

    class TRPOObjective(PolicyGradientObjective):
        """What a learner rank optimises for TRPO: the shared policy-gradient step with a trust-region step 3."""

        def __init__(self, rl: RLConfig, rollout: RolloutConfig, policy: Any, **kwargs: Any) -> None:
            super().__init__(rl, rollout, policy, **kwargs)
            self.settings: TRPOSettings = rl.section()
            self.value_optimizer = torch.optim.Adam(self._head().parameters(), lr=self.settings.value_lr)
            self.states = nn.Identity()  # as group_forward's value head: it returns the decoder's final states

        @property
        def metric_keys(self) -> tuple[str, ...]:
            return (*super().metric_keys, "trpo_kl", "trpo_improvement", "trpo_step_fraction", "trpo_rejected")

        # -- the passes ------------------------------------------------------------------------------------------

        def _head(self) -> ValueHead:
            head = getattr(self.module, "value_head", None)
            assert isinstance(head, ValueHead)
            return head

        def _policy_params(self) -> list[nn.Parameter]:
            """What the step moves: the policy's trainable parameters (under LoRA the adapters), not the head."""
            return [p for p in self.policy.model.parameters() if p.requires_grad]

        def _pass(self, run: StepRunner, batch: GroupBatch) -> tuple[Tensor, Tensor, Tensor]:
            """(full log-prob rows [K*B, T, V] under the sampling transform, the sampled tokens' [K*B, T] (0 at
            padding), the decoder's final states [K*B, T, H]) of the current weights, outside DDP (whose
            hooks expect a backward, not autograd.grad), under the learner's autocast, with the plain attention
            kernel (the fused ones have no double backward). The sampled tokens' log-probs are computed as
            ``_token_logprobs`` computes them."""
            with run.autocast(), sdpa_kernel(SDPBackend.MATH):
                out = group_forward(self.policy.model, batch.input_ids, batch.attention_mask, batch.labels, batch.k,
                                    self.states)  # type: ignore[arg-type]
            assert out.values is not None
            transform: dict[str, Any] = self.transform
            full = warp_logits(out.logits, **transform).log_softmax(dim=-1)
            valid = batch.labels != IGNORE_INDEX
            picked = full.gather(-1, torch.where(valid, batch.labels, 0).unsqueeze(-1)).squeeze(-1)
            return full, torch.where(valid, picked, torch.zeros_like(picked)), out.values

        def _reduce(self, run: StepRunner, vector: Tensor) -> Tensor:
            """The sum over the ranks of a flat vector (float64, on the CPU: run.all_sum's)."""
            return run.all_sum(vector.detach().double().cpu())

        def _surrogate(self, logp: Tensor, exp: Experience, share: float) -> tuple[Tensor, dict[str, Tensor]]:
            """This rank's part of the surrogate (token mean over every rank's tokens of w·ρ·A) and its stats."""
            loss, st = clipped_policy_loss(logp, exp.old_logp, exp.advantages, exp.mask, math.inf,
                                           weights=exp.is_weights)
            return -loss * share, st

        def _kl(self, old_full: Tensor, full: Tensor, exp: Experience, share: float) -> Tensor:
            """This rank's part of the mean KL(π_old ‖ π) over every rank's sampled tokens."""
            return masked_mean(token_kl(old_full.float(), full.float()), exp.mask) * share

        def _shares(self, run: StepRunner, exp: Experience) -> float:
            """This rank's tokens over every rank's (so that a sum over the ranks is a token mean)."""
            local = float(exp.mask.sum())
            total = float(run.all_sum(torch.tensor([local], dtype=torch.float64))[0])
            return local / total if total > 0 else 0.0

        # -- step 3 ----------------------------------------------------------------------------------------------

        def _optimise(self, run: StepRunner, batch: GroupBatch, exp: Experience, step: int
                      ) -> tuple[dict[str, list[float]], int]:
            settings, params = self.settings, self._policy_params()
            share = self._shares(run, exp)
            full, logp, states = self._pass(run, batch)
            states = states.detach()  # the value head's input: its loss must not reach the policy
            surrogate, st = self._surrogate(logp, exp, share)
            old_full = full.detach()
            kl = self._kl(old_full, full, exp, share)
            g = self._reduce(run, flat_grad(surrogate, params, retain_graph=True))
            start = float(self._reduce(run, surrogate.detach().reshape(1))[0])
            grad_kl = flat_grad(kl, params, create_graph=True)

            def fvp(v: Tensor) -> Tensor:
                product = flat_grad(grad_kl @ v.to(grad_kl), params, retain_graph=True)
                return self._reduce(run, product) + settings.damping * v

            best: dict[str, dict[str, Tensor]] = {}

            def evaluate() -> tuple[float, float]:
                with torch.no_grad():
                    new_full, new_logp, _ = self._pass(run, batch)
                    new_surrogate, best["st"] = self._surrogate(new_logp, exp, share)
                    local = torch.stack([new_surrogate.reshape(()), self._kl(old_full, new_full, exp, share)])
                value, new_kl = self._reduce(run, local).tolist()
                return value, new_kl

            accepted, fraction, gain, new_kl = trust_region_step(params, g, fvp, evaluate, start, settings)
            if accepted:
                st = best["st"]
            else:
                log.warning("step %d: TRPO rejected every step of its line search (up to %d from the maximal "
                            "step; none improved the surrogate within mean KL <= rl.trpo.max_kl=%g, or its "
                            "gradient was 0): the policy is unchanged this step", step + 1,
                            settings.line_search_steps, settings.max_kl)
            stats: dict[str, list[float]] = {"grad_norm": [float(g.norm())], "clip_fraction": [0.0],
                                             "value_clip_fraction": [0.0]}
            policy_loss = -(start + gain)
            stats |= {"loss": [policy_loss], "policy_loss": [policy_loss], "trpo_kl": [new_kl],
                      "trpo_improvement": [gain], "trpo_step_fraction": [fraction],
                      "trpo_rejected": [0.0 if accepted else 1.0],
                      **{key: [float(st[key])] for key in ("approx_kl", "ratio_mean", "ratio_max")}}
            stats["value_loss"] = self._value_steps(run, states, exp, share)
            return stats, int(accepted)

        def _value_steps(self, run: StepRunner, states: Tensor, exp: Experience, share: float) -> list[float]:
            """rl.trpo.value_steps Adam steps of the value head alone, on the (detached) decoder states of the
            batch's start; their gradients summed over the ranks. Returns each step's loss."""
            head = self._head()
            assert exp.returns is not None
            params = list(head.parameters())
            losses = []
            for _ in range(self.settings.value_steps):
                loss = 0.5 * masked_mean((head(states) - exp.returns) ** 2, exp.mask)
                grad = self._reduce(run, flat_grad(loss * share, params))
                offset = 0
                for p in params:
                    p.grad = grad[offset : offset + p.numel()].view_as(p).to(p)
                    offset += p.numel()
                torch.nn.utils.clip_grad_norm_(params, self.rl.grad_clip)
                self.value_optimizer.step()
                self.value_optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
            return losses

        def preflight(self, run: StepRunner, batch: GroupBatch) -> None:
            # The peak of a step: the no-grad pass's logits, held while the gradient pass builds the KL's
            # double-backward graph and takes a Fisher-vector product; the learner's reference pass when it
            # scores the reference. No parameter moves and no .grad is left (autograd.grad).
            if self.rl.uses_kl:
                self._reference_logprobs(run, batch)
            with torch.no_grad():
                held = run.forward(batch.input_ids, batch.attention_mask, batch.labels, batch.k)
            params = self._policy_params()
            full, logp, states = self._pass(run, batch)
            mask = batch.loss_mask & torch.isfinite(logp)
            kl = masked_mean(token_kl(full.detach().float(), full.float()), mask)
            grad_kl = flat_grad(kl, params, create_graph=True)
            g = flat_grad(-masked_mean(torch.where(mask, logp, 0), mask), params, retain_graph=True)
            flat_grad(grad_kl @ g, params)
            head = self._head()
            flat_grad(masked_mean(head(states.detach()) ** 2, mask), list(head.parameters()))
            del held

        # -- state -----------------------------------------------------------------------------------------------

        def state_dict(self) -> dict[str, Any]:
            return {**super().state_dict(), "value_optimizer": copy.deepcopy(self.value_optimizer.state_dict())}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            super().load_state_dict(state)
            self.value_optimizer.load_state_dict(state["value_optimizer"])

    return TRPOObjective
