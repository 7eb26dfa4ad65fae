"""RL with a reward of your own: a plain Python function, on the synthetic report task.

    python examples/custom_reward.py [RUN_DIR] [key.path=value ...]

The function gets a batch of sampled candidates with their sources and references (and each data row's extra
fields as keyword lists) and returns one float per candidate. `rlt2t.train` takes it as the reward and ships it to
the Ray reward workers with the config. The demo's model and task without its pretraining, and RL on 256
sources: about 2.5 minutes on a 2-core CPU, enough for SFT to learn the task in part (task score ~0.6 on the
validation split; the demo's full schedule reaches ~1.0). RL then optimises this reward, not the task score:
expect the candidates to grow longer, towards the reference's tokens. `metric.monitor=reward` makes the same
reward pick RL's best checkpoint (the one `evaluate` loads as "rl"); without it, CIDEr-D would.
"""

import sys

import rlt2t


def overlap_minus_length(sources, candidates, references, **row_fields):
    """Share of the reference's tokens the candidate has, minus 0.02 per token beyond the reference's length."""
    scores = []
    for candidate, refs in zip(candidates, references, strict=True):
        words, ref = candidate.split(), refs[0].split()
        scores.append(len(set(words) & set(ref)) / len(set(ref)) - 0.02 * max(len(words) - len(ref), 0))
    return scores


if __name__ == "__main__":  # the Ray workers unpickle the function, they do not run the script
    run = next((a for a in sys.argv[1:] if "=" not in a), "runs/custom_reward")
    overrides = [a for a in sys.argv[1:] if "=" in a]
    cfg = rlt2t.load_config(overrides=[f"run.dir={run}", "rl.algorithm=grpo", "pretrain.enabled=false",
                                       "rl.train_subset=256", *overrides])
    if not cfg.path(cfg.data.train).is_file():
        rlt2t.synth_data(cfg)
    rlt2t.build_tokenizer(cfg)
    rlt2t.sft(cfg)
    cfg.metric.monitor = "reward"  # RL keeps the checkpoint whose validation outputs earn the most of this reward
    rlt2t.train(cfg, reward=overlap_minus_length)
    print(rlt2t.evaluate(cfg, ["sft", "rl"], metrics=["task_score", "mean_length"]).to_markdown())
