"""TRPO (learner/algorithms/trpo.py): on a softmax policy small enough to form its Fisher matrix, the
Fisher-vector products are F·v, conjugate gradient gives F⁻¹g and the accepted step keeps the mean KL within δ
and raises the surrogate; on tiny BART and T5 one learner step does the same, measured apart from the code's own
logs; the value head's steps leave the policy alone, LoRA moves only the adapters, and the state (value head and
its optimiser) round-trips bitwise."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from rlt2t.actors.reward import RewardWorker
from rlt2t.actors.rollout import RolloutWorker
from rlt2t.common.config import ConfigError, ModelConfig, RewardConfig, RLConfig, RolloutConfig, load_config
from rlt2t.common.data import Example
from rlt2t.common.lora import policy_weights
from rlt2t.common.metrics import DocumentFrequency
from rlt2t.common.policy import load_policy
from rlt2t.common.types import RolloutSpec
from rlt2t.learner.algorithms import trpo
from rlt2t.learner.algorithms.trpo import (
    TRPOSettings,
    conjugate_gradient,
    flat_grad,
    token_kl,
    trust_region_step,
)
from rlt2t.learner.group_step import group_forward
from rlt2t.learner.learner import Learner
from rlt2t.learner.losses import masked_mean

ALGORITHM = "trpo"
WORDS = ["alpha beta gamma delta", "river stone", "quick slow red green blue", "mu nu xi", "small large red",
         "pi rho sigma tau", "green river", "omega psi chi"]
FAMILY_EXAMPLES = [Example(id=f"f{i}", source=s, target=WORDS[(i + 3) % len(WORDS)]) for i, s in enumerate(WORDS)]


# -- a softmax policy: S states with features x_s, logits x_s·W, W the only parameter --------------------------------

S, D, V = 5, 3, 4


def _softmax_problem(identifiable: bool = False):
    """W [D, V] (a softmax's logits are defined up to a shift: F is singular), or, identifiable, W [D, V - 1] with
    the last logit fixed at 0 (F positive definite)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, D, generator=gen, dtype=torch.float64)
    columns = V - 1 if identifiable else V
    w = torch.nn.Parameter(torch.randn(D, columns, generator=gen, dtype=torch.float64))
    actions = torch.randint(0, V, (S,), generator=gen)
    advantages = torch.randn(S, generator=gen, dtype=torch.float64)

    def logp_of(weights: torch.Tensor) -> torch.Tensor:
        logits = x @ weights.view(D, columns)
        if identifiable:
            logits = torch.cat([logits, torch.zeros(S, 1, dtype=logits.dtype)], dim=-1)
        return logits.log_softmax(-1)

    old = logp_of(w).detach()

    def kl(weights: torch.Tensor) -> torch.Tensor:
        return token_kl(old, logp_of(weights)).mean()

    def surrogate(weights: torch.Tensor) -> torch.Tensor:
        logp = logp_of(weights).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return (torch.exp(logp - old.gather(-1, actions.unsqueeze(-1)).squeeze(-1)) * advantages).mean()

    return w, kl, surrogate


@pytest.mark.parametrize(("identifiable", "damping"), [(True, 0.0), (True, 0.1), (False, 0.1)],
                         ids=["F-invertible", "F-invertible-damped", "F-singular-damped"])
def test_conjugate_gradient_on_fisher_vector_products_is_the_inverse_fisher_times_g(identifiable, damping):
    w, kl, surrogate = _softmax_problem(identifiable)
    n = w.numel()
    g = flat_grad(surrogate(w), [w])
    grad_kl = flat_grad(kl(w), [w], create_graph=True)

    def fvp(v: torch.Tensor) -> torch.Tensor:
        return flat_grad(grad_kl @ v, [w], retain_graph=True) + damping * v

    # F formed: the Hessian of the mean KL at the start (= the Fisher matrix of the softmax policy)
    fisher = torch.autograd.functional.hessian(kl, w.detach().reshape(-1))
    v = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.allclose(fvp(v), fisher @ v + damping * v, atol=1e-10)
    # the softmax's logits are defined up to a shift: without the fixed logit F is singular, and damping needed
    assert (torch.linalg.matrix_rank(fisher) == n) == identifiable
    direction = conjugate_gradient(fvp, g, iters=n)
    expected = torch.linalg.solve(fisher + damping * torch.eye(n, dtype=torch.float64), g)
    assert (direction - expected).abs().max() < 1e-4


@pytest.mark.parametrize("max_kl", [0.01, 0.001])
def test_the_accepted_step_raises_the_surrogate_within_the_kl_bound(max_kl):
    w, kl, surrogate = _softmax_problem()
    settings = TRPOSettings(max_kl=max_kl, cg_iters=D * V, damping=1e-3)
    start = float(surrogate(w).detach())
    g = flat_grad(surrogate(w), [w])
    grad_kl = flat_grad(kl(w), [w], create_graph=True)

    def fvp(v):
        return flat_grad(grad_kl @ v, [w], retain_graph=True) + settings.damping * v

    def evaluate():
        with torch.no_grad():
            return float(surrogate(w)), float(kl(w))

    accepted, fraction, gain, step_kl = trust_region_step([w], g, fvp, evaluate, start, settings)
    assert accepted and 0 < fraction <= 1
    assert float(kl(w).detach()) == step_kl <= max_kl
    assert float(surrogate(w).detach()) - start == pytest.approx(gain) and gain > 0
    # the quadratic model is good this close (and the damping small): the maximal step is taken, its KL near δ
    assert fraction == 1 and step_kl > 0.5 * max_kl


def test_a_line_search_that_rejects_every_step_puts_the_parameters_back():
    w, kl, surrogate = _softmax_problem()
    before = w.detach().clone()
    g = flat_grad(surrogate(w), [w])
    grad_kl = flat_grad(kl(w), [w], create_graph=True)
    calls = []

    def evaluate():  # a surrogate that never improves
        calls.append(1)
        return -1.0, 0.0

    result = trust_region_step([w], g, lambda v: flat_grad(grad_kl @ v, [w], retain_graph=True) + 0.1 * v, evaluate,
                               0.0, TRPOSettings(line_search_steps=4))
    assert result == (False, 0.0, 0.0, 0.0) and len(calls) == 4
    assert torch.equal(w.detach(), before)
    # a zero gradient (every advantage 0): no step is tried
    assert trust_region_step([w], torch.zeros_like(g), lambda v: v, evaluate, 0.0, TRPOSettings())[0] is False


# -- the learner's step on real encoder-decoders ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bart(family_dirs) -> tuple[ModelConfig, Path]:
    """The tiny BART of the family tests (large random weights: samples that depend on the source)."""
    return ModelConfig(preset=None, path=str(family_dirs["bart"]), dropout=0.0), family_dirs["bart"]


def _rl(**trpo) -> RLConfig:
    return RLConfig(algorithm=ALGORITHM, batch_size=8, kl={"coef": 0.05}, trpo=trpo)


def _groups(model: ModelConfig, checkpoint: Path, examples=FAMILY_EXAMPLES, rollout=None, spec=None):
    rollout = rollout or RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8)
    spec = spec or RolloutSpec("group", reference=True)
    start = load_policy(model, checkpoint=checkpoint).model.state_dict()
    worker = RolloutWorker(model, str(checkpoint), rollout, seed=3, max_source_len=16, spec=spec, start_weights=start)
    worker.set_weights(0, policy_weights(load_policy(model, checkpoint=checkpoint).model))
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in examples]))
    return reward.score(worker.sample(examples))


def _learner(model: ModelConfig, checkpoint: Path, rl: RLConfig, rollout=None) -> Learner:
    return Learner(model, str(checkpoint), rl, rollout or RolloutConfig(num_samples=3, top_k=0, max_new_tokens=8),
                   init_checkpoint=str(checkpoint), rank=0, world_size=1, total_steps=10, seed=0, max_source_len=16,
                   max_target_len=16)


def _mean_kl(before: torch.nn.Module, after: torch.nn.Module, batch) -> float:
    """The mean KL(before ‖ after) over the batch's sampled tokens, computed here from two forward passes."""
    with torch.no_grad():
        old = group_forward(before, batch.input_ids, batch.attention_mask, batch.labels, batch.k).logits
        new = group_forward(after, batch.input_ids, batch.attention_mask, batch.labels, batch.k).logits
    return float(masked_mean(token_kl(old.log_softmax(-1), new.log_softmax(-1)), batch.loss_mask))


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_one_step_on_bart_and_t5_raises_the_surrogate_within_the_bound(family, family_dirs, caplog):
    path = family_dirs[family]
    model = ModelConfig(preset=None, path=str(path), dropout=0.0)
    groups = _groups(model, path, FAMILY_EXAMPLES)
    learner = _learner(model, path, _rl(max_kl=0.01))
    start = copy.deepcopy(learner.policy.model)
    seen = []
    optimise = learner.objective._optimise

    def spy(run, batch, exp, step):  # the step's advantages and weights, to measure the surrogate with
        seen.append(exp)
        return optimise(run, batch, exp, step)

    learner.objective._optimise = spy
    with caplog.at_level(logging.WARNING, logger="rlt2t.learner"):
        metrics = learner.train_step(groups)
    assert "rejected every step" not in caplog.text
    assert metrics["trpo_rejected"] == 0 and metrics["optimizer_steps"] == 1
    assert metrics["trpo_improvement"] > 0 and metrics["trpo_step_fraction"] > 0
    assert metrics["sampler_ratio_max_dev"] < 1e-4  # the learner's pass is the sampler's policy
    batch = learner.objective.collate(groups, max_source_len=16, max_target_len=16)
    measured = _mean_kl(start, learner.policy.model, batch)
    assert 0 < measured <= 0.01 and measured == pytest.approx(metrics["trpo_kl"], rel=1e-4)
    # the surrogate, token mean of w·ρ·A, measured here before and after the step
    exp = seen[0]

    def surrogate(model):
        with torch.no_grad():
            logits = group_forward(model, batch.input_ids, batch.attention_mask, batch.labels, batch.k).logits
        logp = logits.log_softmax(-1).gather(-1, batch.labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(torch.where(exp.mask, logp - exp.old_logp, 0))
        return float(masked_mean(exp.is_weights * ratio * exp.advantages, exp.mask))

    before, after = surrogate(start), surrogate(learner.policy.model)
    assert after > before and after - before == pytest.approx(metrics["trpo_improvement"], rel=1e-3)


def test_the_value_steps_move_the_head_and_never_the_policy(bart, caplog, monkeypatch):
    groups = _groups(*bart)
    # a line search that sees no step improve (each tried on the model, then put back): only the head may move
    real = trpo.trust_region_step
    monkeypatch.setattr(trpo, "trust_region_step", lambda params, g, fvp, evaluate, start, settings: real(
        params, g, fvp, lambda: (evaluate()[0] - 1e9, 0.0), start, settings))
    learner = _learner(*bart, _rl(value_steps=3))
    before = {k: v.clone() for k, v in learner.policy.model.state_dict().items()}
    head = learner.objective.module.value_head
    head_before = {k: v.clone() for k, v in head.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="rlt2t.learner"):
        metrics = learner.train_step(groups)
    assert "TRPO rejected every step of its line search" in caplog.text
    assert metrics["trpo_rejected"] == 1 and metrics["optimizer_steps"] == 0 and metrics["trpo_kl"] == 0
    after = learner.policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the policy moved"
    assert any(not torch.equal(head_before[k], v) for k, v in head.state_dict().items()), "the head did not train"
    assert metrics["value_loss"] > 0


def test_the_value_loss_falls_over_its_steps(bart):
    learner = _learner(*bart, _rl(value_steps=8))
    groups = _groups(*bart)
    losses = []
    original = learner.objective._value_steps

    def record(*args, **kwargs):
        losses.extend(original(*args, **kwargs))
        return losses

    learner.objective._value_steps = record
    learner.train_step(groups)
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_under_lora_only_the_adapters_move(bart):
    model, path = bart
    lora = ModelConfig.model_validate({**model.model_dump(), "lora": {"enabled": True, "r": 4, "alpha": 8.0,
                                                                      "dropout": 0.0}})
    learner = _learner(lora, path, _rl())
    base = learner.policy.model.get_base_model()
    base_before = {k: v.clone() for k, v in base.state_dict().items() if "lora_" not in k}
    adapters_before = {k: v.clone() for k, v in learner.weights().items()}
    # samples of the base: the adapters start at zero, so the policy is the base
    metrics = learner.train_step(_groups(*bart))
    assert metrics["trpo_rejected"] == 0
    base_after = {k: v for k, v in base.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before), "the frozen base changed"
    adapters = learner.weights()
    assert any(not torch.equal(adapters_before[k], adapters[k]) for k in adapters), "the adapters did not move"


def test_state_round_trip_continues_bitwise(bart):
    """The value head, its Adam moments and the KL controller come back: the next step is identical."""
    rl = RLConfig(algorithm=ALGORITHM, batch_size=8, kl={"coef": 0.1, "target": 1.0, "horizon": 50})
    worker_groups = _groups(*bart)
    batches = [worker_groups[:4], worker_groups[4:]]
    a = _learner(*bart, rl)
    a.train_step(batches[0])
    state, weights = a.training_state(), a.weights()
    assert state["objective"]["value_optimizer"]["state"] and "value_head" in state["objective"]
    ma = a.train_step(batches[1])
    b = _learner(*bart, rl)
    b.policy.model.load_state_dict(weights)
    b.load_training_state(state)
    mb = b.train_step(batches[1])
    wa, wb = a.weights(), b.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    ha, hb = a.objective.state_dict()["value_head"], b.objective.state_dict()["value_head"]
    assert all(torch.equal(ha[k], hb[k]) for k in ha)
    assert ma == {**mb, "step_s": ma["step_s"]}


def test_preflight_leaves_training_unchanged(bart):
    groups = _groups(*bart)
    runs = []
    for preflight in (False, True):
        learner = _learner(*bart, _rl())
        if preflight:
            assert learner.preflight()["peak_memory_gib"] > 0
            assert all(p.grad is None for p in learner.objective.module.parameters())
        runs.append(learner.train_step(groups)["loss"])
    assert runs[0] == runs[1]


def test_its_settings_and_rules():
    cfg = load_config(overrides=[f"rl.algorithm={ALGORITHM}", "rl.trpo.max_kl=0.02", "rl.trpo.cg_iters=5"])
    assert cfg.rl.section() == TRPOSettings(max_kl=0.02, cg_iters=5)
    assert (cfg.rl.optimisation_epochs, cfg.rl.optimisation_minibatches) == (1, 1)
    assert cfg.rl.rollout_spec.kind == "group"
    with pytest.raises(ConfigError, match="rl.trpo.max_kl"):
        load_config(overrides=[f"rl.algorithm={ALGORITHM}", "rl.trpo.max_kl=0"])
    for key in ("sft_coef", "entropy_coef"):
        with pytest.raises(ConfigError, match=f"rl.pg.{key}: TRPO"):
            load_config(overrides=[f"rl.algorithm={ALGORITHM}", f"rl.pg.{key}=0.1"])


def test_validating_a_trpo_config_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from rlt2t.common.config import load_config; "
            f"load_config(overrides=['rl.algorithm={ALGORITHM}', 'rl.trpo.cg_iters=3']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "False", out.stdout + out.stderr
