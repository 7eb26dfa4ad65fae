"""Whether two code trees train every RL algorithm identically: the weights after a few learner steps of each
algorithm, bitwise.

    python bench/algorithm_units.py --record /tmp/before.json      # in the tree before a change
    python bench/algorithm_units.py --compare /tmp/before.json      # in the tree after it: saves
                                                                    # bench/results/algorithm_units.json

For each algorithm of the registry (rank RL and the policy gradients) a tiny BART with wide random weights,
the real RolloutWorker and RewardWorker (no Ray), and a Learner of world size 1 take ``--steps`` steps, the
rollouts sampling with the learner's latest weights after each step (NLPO's masking policy refreshed every
step). The record holds each algorithm's SHA-256 over its final weights (and value head, where it has one) and
its last step's metrics; ``--compare`` recomputes them here and reports, per algorithm, whether the weights are
bitwise those of the record. Meant for refactors that must change no behaviour (the move of the algorithms
into plug-in units, issue #39); both runs must be on one machine and torch build.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine, save  # noqa: E402

from rlt2t.actors.reward import RewardWorker  # noqa: E402
from rlt2t.actors.rollout import RolloutWorker  # noqa: E402
from rlt2t.common.config import ModelConfig, RewardConfig, RLConfig, RolloutConfig  # noqa: E402
from rlt2t.common.data import Example  # noqa: E402
from rlt2t.common.metrics import DocumentFrequency  # noqa: E402
from rlt2t.common.policy import load_policy  # noqa: E402
from rlt2t.common.tokenization import build_ids_tokenizer, save_tokenizer  # noqa: E402
from rlt2t.common.tracking import quiet_transformers  # noqa: E402
from rlt2t.learner.learner import Learner  # noqa: E402

MODEL = ModelConfig(preset="tiny", dropout=0.1)
EXAMPLES = [Example(id=f"ex{i}", source=" ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i % 4)),
                    target=" ".join(str(10 + (i * 3 + j) % 50) for j in range(2 + i % 3))) for i in range(8)]
ALGORITHMS = ("rank", "scst", "rloo", "grpo", "ppo", "a2c", "nlpo")


def _init_dir(root: Path) -> Path:
    tok = root / "tok"
    save_tokenizer(build_ids_tokenizer(num_data_tokens=60, num_sentinels=4), tok)
    policy = load_policy(ModelConfig(preset="tiny", dropout=0.0), tok, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 2.0 / param.shape[-1] ** 0.5)
        policy.model.final_logits_bias[0, policy.tokenizer.eos_token_id] = 1.5
    out = root / "init"
    policy.model.save_pretrained(out)
    policy.tokenizer.save_pretrained(out)
    return out


def _rollout_spec(rl: RLConfig):
    if hasattr(type(rl), "rollout_spec"):
        return rl.rollout_spec
    from rlt2t.common.types import RolloutSpec  # the trees before the rollout_spec property

    return RolloutSpec.for_algorithm(rl.algorithm, kl=rl.uses_kl, mask_top_p=rl.pg.nlpo_top_p)


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(algorithm: str, init_dir: Path, steps: int) -> dict:
    torch.manual_seed(0)
    rollout = RolloutConfig(num_samples=4, top_k=0, max_new_tokens=8)
    rl = RLConfig(algorithm=algorithm, batch_size=8, lr=3e-3,
                  **({} if algorithm == "rank" else {"kl": {"coef": 0.1, "target": 1.0, "horizon": 100},
                                                      "pg": {"nlpo_top_p": 0.95, "nlpo_mask_refresh_steps": 1}}))
    spec = _rollout_spec(rl)
    weights = load_policy(MODEL, checkpoint=init_dir).model.state_dict()
    worker = RolloutWorker(MODEL, str(init_dir), rollout, seed=3, max_source_len=16, spec=spec,
                           start_weights=weights if spec.reference else None)
    worker.set_weights(0, weights)
    learner = Learner(MODEL, None, rl, rollout, init_checkpoint=str(init_dir), rank=0, world_size=1,
                      total_steps=10, seed=0, max_source_len=16, max_target_len=16)
    reward = RewardWorker(RewardConfig(), DocumentFrequency.from_references([[e.target] for e in EXAMPLES]))
    metrics: dict = {}
    for step in range(steps):
        mask_model = getattr(learner.objective, "mask_model", None)
        if mask_model is not None:  # NLPO: the masking policy is the current weights
            worker.mask_model = copy.deepcopy(worker.policy.model)
            worker.mask_model.load_state_dict(mask_model.state_dict())
        metrics = learner.train_step(reward.score(worker.sample(EXAMPLES)))
        worker.set_weights(step + 1, learner.weights())
    state = dict(learner.weights())
    head = getattr(learner.objective.module, "value_head", None)
    if head is not None:
        state.update({f"value_head.{k}": v for k, v in head.state_dict().items()})
    kept = {k: v for k, v in metrics.items() if k not in ("step_s", "wait_s") and isinstance(v, (int, float))}
    return {"weights_sha256": _digest(state), "last_step": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--record", type=Path, help="write this tree's digests to this file")
    what.add_argument("--compare", type=Path, help="compare this tree's digests with a recorded file")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    args = ap.parse_args()
    quiet_transformers()
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        init_dir = _init_dir(Path(tmp))
        here = {a: run(a, init_dir, args.steps) for a in args.algorithms.split(",")}
    if args.record:
        args.record.write_text(json.dumps({"machine": machine(), "steps": args.steps, "algorithms": here}, indent=1))
        print(f"recorded {len(here)} algorithms to {args.record}")
        return
    before = json.loads(args.compare.read_text())
    rows = {}
    for name, now in here.items():
        then = before["algorithms"].get(name)
        same = then is not None and then["weights_sha256"] == now["weights_sha256"]
        rows[name] = {"bitwise_equal": same, "before": then and then["weights_sha256"], "after": now["weights_sha256"]}
        print(f"{name:6s} {'bitwise equal' if same else 'DIFFERENT'}  {now['weights_sha256'][:16]}")
    path = save("algorithm_units", {"steps": args.steps, "recorded_on": before["machine"], "algorithms": rows,
                                    "all_equal": all(r["bitwise_equal"] for r in rows.values())})
    print(f"saved {path}")
    if not all(r["bitwise_equal"] for r in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
