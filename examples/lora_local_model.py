"""LoRA adapters on a local pretrained model directory: SFT, then RL, then the base against the tuned model.

    python examples/lora_local_model.py MODEL_DIR [RUN_DIR] [key.path=value ...]

MODEL_DIR is a Hugging Face encoder-decoder saved with `save_pretrained` (BART, T5, Marian, mBART, Pegasus),
with its tokenizer: rlt2t reads both from it and trains only the adapters (model.lora.*) on the frozen base.
Without data.train the synthetic task is written for it; give your own with data.train=... data.valid=...
"""

import sys

import rlt2t

model_dir, *rest = sys.argv[1:]
run = next((a for a in rest if "=" not in a), "runs/lora_local_model")
cfg = rlt2t.load_config("tiny", overrides=[
    f"run.dir={run}", f"model.path={model_dir}", "model.preset=null",  # the directory's model and tokenizer
    "model.lora.enabled=true", "model.lora.r=8", "pretrain.enabled=false",
    "sft.lr=1e-3", "rl.algorithm=grpo",  # adapters learn at a higher rate than full fine-tuning
    *(a for a in rest if "=" in a),
])
if not cfg.path(cfg.data.train).is_file():
    rlt2t.synth_data(cfg)
sft = rlt2t.sft(cfg)  # adapters only: the checkpoints hold them, not the base
print(f"SFT: {sft.steps} steps -> {sft.checkpoint}")
rlt2t.train(cfg)  # RL on the adapters; the KL's reference is the base with them switched off
print(rlt2t.evaluate(cfg, [f"base={model_dir}", "sft", "rl"]).to_markdown())
