"""Train from a Hugging Face `datasets` directory whose columns have names of their own.

    python examples/datasets_columns.py [RUN_DIR] [key.path=value ...]

Any dataset saved with `save_to_disk` reads the same way: point data.train / data.valid at a split's directory
and say which columns hold the source and the target. Here the rows are the synthetic task's, in columns
`document` and `summary` and without an id column (rows are then numbered 1, 2, ...). Tiny settings, a minute
on a laptop CPU: scores of so short a run stay near zero (raise sft.epochs for a real one).
"""

import sys

from datasets import Dataset

import rlt2t
from rlt2t.common.synth import generate_synthetic

run = next((a for a in sys.argv[1:] if "=" not in a), "runs/datasets_columns")
overrides = [a for a in sys.argv[1:] if "=" in a]  # applied after the example's settings
rows = generate_synthetic(360, seed=7)
for split, part in (("train", rows[:300]), ("validation", rows[300:])):
    columns = {"document": [e.source for e in part], "summary": [e.target for e in part]}
    Dataset.from_dict(columns).save_to_disk(f"{run}/hf/{split}")

cfg = rlt2t.load_config("tiny", overrides=[
    f"run.dir={run}",
    f"data.train={run}/hf/train", f"data.valid={run}/hf/validation",
    "data.source_field=document", "data.target_field=summary",  # data.format: auto (a directory: datasets)
    "pretrain.enabled=false", "rl.epochs=1",
    *overrides,
])
rlt2t.build_tokenizer(cfg)
rlt2t.sft(cfg)
rlt2t.train(cfg)  # RL (rl.algorithm) on the same columns
print(rlt2t.evaluate(cfg, ["sft", "rl"]).to_markdown())
