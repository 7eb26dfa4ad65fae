"""The run, its data and its model: `run`, `synth`, `data`, `tokenizer`, `model` (with `model.lora`), and the
supervised stages `pretrain` and `sft`."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from rlt2t.common.config.base import _Section, shared_directory


class RunConfig(_Section):
    dir: str = Field("runs/demo", min_length=1, pattern=r"\S")
    """Output directory of the run: data, tokenizer, checkpoints, logs and reports go under it."""

    @model_validator(mode="after")
    def _a_directory_of_its_own(self) -> RunConfig:
        if (problem := shared_directory(self.dir)) is not None:
            raise ValueError(f"run.dir={self.dir!r} {problem}: the run needs a directory of its own (it writes "
                             "data/, checkpoints and logs under it); e.g. run.dir=runs/demo")
        return self
    seed: int = 1234
    """Seed for every random choice (data order, noise, dropout, sampling)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` takes CUDA when present."""
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    """Mixed precision through accelerate (GPU only; CPU runs in float32)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads; 0 leaves torch's default."""
    log_every: int = Field(10, ge=1)
    """Log training metrics every this many optimizer steps."""
    progress: bool = True
    """Show progress on long work: a bar on a terminal; otherwise (a log file, a Ray job) pretraining and SFT
    log their step, loss, pace and time left at most every 30 s (RL logs its line every `run.log_every` steps
    either way)."""


class SynthConfig(_Section):
    size: int = Field(4800, ge=1, le=1_000_000)
    """Number of synthetic rows (train + valid + test: 3,600 + 600 + 600 by default)."""
    seed: int = 7
    """Seed of the synthetic generator: same seed, same bytes."""
    valid_fraction: float = Field(0.125, ge=0.0, lt=0.5)
    """Fraction of rows in the validation split."""
    test_fraction: float = Field(0.125, ge=0.0, lt=0.5)
    """Fraction of rows in the held-out test split."""


class DataConfig(_Section):
    train: str = "{run}/data/train.jsonl"
    """Training data (`id`, `source`, `target` by default: data.*_field): a JSONL, CSV or Parquet file or a
    Hugging Face datasets directory (data.format); `{run}` expands to run.dir."""
    valid: str = "{run}/data/valid.jsonl"
    """Validation data (as data.train)."""
    test: str = "{run}/data/test.jsonl"
    """Held-out test data (as data.train; targets optional)."""
    unlabeled: list[str] = []  # pydantic copies the default
    """Files of unlabelled text (any format of data.format; only the source column is read) that denoising
    pretraining and the subword tokenizer (`rlt2t tokenizer build`) read besides the splits; `{run}` expands."""
    format: Literal["auto", "jsonl", "csv", "parquet", "datasets"] = "auto"
    """How data files are read. `auto`: by the path (a directory or `.arrow` file: datasets; `.parquet`/`.pq`:
    Parquet; `.csv`/`.tsv`: CSV with a header; else JSONL). `datasets` on a `.jsonl`/`.csv`/`.parquet` file loads
    it through `datasets.load_dataset` (a memory-mapped Arrow cache)."""
    id_field: str = Field("id", min_length=1)
    """Field (column) of the example ids; a CSV, Parquet or datasets file without it numbers its rows 1, 2, ..."""
    source_field: str = Field("source", min_length=1)
    """Field (column) of the source texts."""
    target_field: str = Field("target", min_length=1)
    """Field (column) of the target texts (optional when data.references_field gives references)."""
    references_field: str = Field("references", min_length=1)
    """Field (column) of a row's several references: a list of strings (in a CSV cell, a JSON list)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines (rows) stop the run (`raise`) or are skipped and counted in the log (`skip`)."""

    @model_validator(mode="after")
    def _distinct_fields(self) -> DataConfig:
        names = [self.id_field, self.source_field, self.target_field, self.references_field]
        if len(set(names)) < len(names):
            raise ValueError(f"data.id_field, source_field, target_field and references_field must name different "
                             f"fields, got {', '.join(map(repr, names))}")
        return self
    max_source_len: int = Field(128, ge=2)
    """Source tokens kept (longer sources are truncated, with a count in the log)."""
    max_target_len: int = Field(64, ge=2)
    """Target tokens kept, EOS included."""


class TokenizerConfig(_Section):
    kind: Literal["ids", "subword", "pretrained"] = "ids"
    """`ids`: space-separated integer tokens (data token k = model id k + offset); `subword`: a BPE
    trained on the training file; `pretrained`: a saved Hugging Face tokenizer directory (`path`)."""
    path: str | None = None
    """Tokenizer directory to load (`pretrained`), or where to save a built one (default {run}/tokenizer)."""
    num_data_tokens: int = Field(1894, ge=1)
    """`ids` only: data tokens 0..N-1; the model vocabulary is offset + N."""
    num_sentinels: int = Field(100, ge=1)
    """Sentinel tokens for span corruption (`ids` and `subword`)."""
    vocab_size: int = Field(8000, ge=64)
    """`subword` only: the most tokens the BPE learns (a small corpus gives fewer); at least 263 +
    tokenizer.num_sentinels (the special tokens, the sentinels and the 256 bytes come first: 363 by default)."""


class LoraConfig(_Section):
    """LoRA adapters (through peft): only the low-rank adapter weights are trained, checkpointed and published."""

    enabled: bool = False
    """Train LoRA adapters on a frozen base instead of every weight (needs a pretrained base directory)."""
    r: int = Field(8, ge=1)
    """Rank of each adapter's update B·A."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale: the update is (alpha / r)·B·A."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapters' input."""
    target_modules: list[str] | None = None
    """Names of the linear layers to adapt (None: the family's attention query/value projections, by the
    model's config.model_type: q_proj/v_proj for bart, mbart, marian, pegasus; q/v for t5, mt5)."""


class ModelConfig(_Section):
    preset: Literal["tiny", "small", "base"] | None = "small"
    """Build from scratch with this shape: `tiny` (tests), `small` (a few M params), `base` (BART-base)."""
    family: Literal["bart", "t5", "marian", "mbart", "pegasus"] = "mbart"
    """Architecture of a from-scratch preset (a loaded directory's family comes from its config.json). `mbart` is
    BART with its layer norms before each block (pre-norm), which learns from scratch more steadily: on the demo's
    task post-norm `bart` wrote one text whatever the source for one to five SFT epochs, depending on the seed."""
    path: str | None = None
    """A local pretrained encoder-decoder directory (BART, T5/Flan-T5/mT5, Marian, mBART, Pegasus, or a
    warm-started EncoderDecoderModel); takes precedence over `preset`."""
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    """Dropout of a model built from a preset (also applied to a loaded model)."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (model.lora.enabled, r, alpha, dropout, target_modules)."""
    src_lang: str | None = None
    """mBART: source language code (e.g. en_XX); the tokenizer adds it to every text it encodes."""
    tgt_lang: str | None = None
    """mBART: target language code (e.g. ro_RO); decoding starts from it (None: the model's own start)."""


class StageConfig(_Section):
    """Optimisation settings shared by the training stages."""

    enabled: bool = True
    """Run this stage in the pipeline."""
    epochs: int = Field(1, ge=1)
    """Passes over the training data."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps (0: no limit)."""
    batch_size: int = Field(32, ge=1)
    """Examples per optimizer step (over all ranks, when the stage runs on several)."""
    lr: float = Field(2e-5, gt=0.0)
    """Peak learning rate (AdamW)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay."""
    warmup_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Fraction of steps of linear warmup."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Linear decay ends at this fraction of the peak learning rate (the floor)."""
    grad_clip: float = Field(0.5, gt=0.0)
    """Gradient-norm clipping."""
    save_every_steps: int = Field(0, ge=0)
    """Also checkpoint every N steps (0: at the end of each epoch only)."""
    keep_last: int = Field(3, ge=1)
    """Checkpoints kept (oldest deleted first)."""


class TextStageConfig(StageConfig):
    """A stage that trains the policy on (source, target) token sequences: pretraining and the SFT stages."""

    group_by_length: bool = True
    """Batch examples of similar source length together: each epoch's shuffled order is cut into windows of 64
    batches, each window sorted by source length and cut into batches, and the batches shuffled (the order still
    depends only on run.seed and the epoch; targets are not sorted). A batch then pads its sources to about their
    own length rather than the longest of a random draw, so a step computes fewer padding tokens. false: batches
    of uniformly random examples, the order of earlier versions (CHANGELOG)."""
    strategy: Literal["local", "ddp", "fsdp"] = "local"
    """Where the stage trains: `local`, in the job's own process on one device; `ddp` or `fsdp`, on rl.learners
    Ray actors with the RL learner's resources (rl.learner_cpus, rl.learner_gpus, rl.learner_resources), as the
    RL learner does under rl.strategy: every rank a whole copy of the model (`ddp`), or 1/rl.learners of its
    weights, gradients and AdamW moments (`fsdp`, FSDP2 with rl.fsdp's options). `batch_size` is then the batch
    of all ranks together. The ranks read the data and write the checkpoints in run.dir: one node, or a
    filesystem every node mounts at that path. Resume with the same strategy and rl.learners."""


class PretrainConfig(TextStageConfig):
    group_by_length: bool = False
    """Batch texts of similar length together (as `sft.group_by_length` does). Off by default: pretraining's texts
    are the sources and the targets, whose lengths differ, so grouped batches hold one kind of text each; on the
    demo's task (one seed) the SFT that followed a grouped pretraining learnt to read its sources later."""
    lr: float = Field(5e-4, gt=0.0)
    """Peak learning rate (AdamW)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps (0: no limit, `epochs` full passes; the default, one pass, is what the
    demo's from-scratch model needs before SFT learns on every seed)."""
    objective: Literal["span_corruption", "reconstruct"] = "span_corruption"
    """What the decoder writes for a span-corrupted text: `span_corruption` only the masked spans after their
    sentinels (T5's objective: short labels), `reconstruct` the whole text (BART's text infilling: longer labels;
    what a pretrained BART was trained with)."""
    noise_density: float = Field(0.15, gt=0.0, lt=1.0)
    """Fraction of tokens masked by span corruption."""
    mean_span_length: float = Field(3.0, ge=1.0)
    """Mean length of a masked span."""


class SFTConfig(TextStageConfig):
    lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate (the original used 2e-5 on a pretrained BART-base; scratch models want more)."""
    epochs: int = Field(6, ge=1)
    """Most passes over the training data (the learning-rate schedule spans them all; `patience` may stop
    sooner)."""
    patience: int = Field(1, ge=0)
    """Stop once the validation monitor has not beaten its best for this many epochs in a row (0: run every
    epoch). Epochs whose greedy outputs have collapsed do not count. The best checkpoint is what later stages
    start from either way; needs a validation split."""
    monitor: Literal["loss", "metric"] = "loss"
    """What picks the best checkpoint and stops early: `loss`, the cross-entropy of the validation references
    (teacher forcing; lower is better; logged as `valid_loss`, the monitor is its negative), or `metric`, the
    greedy outputs' score by `metric.monitor` (default (1-w)·CIDEr-D + w·BLEU-4), which RL's monitor uses. `loss`
    stops SFT where likelihood training has converged; the metric of greedy outputs can peak earlier, on a model
    that has not yet learnt its mapping (it hedges towards tokens the references share), and swings from epoch to
    epoch. Continued SFT, RL's baseline, keeps its best by `metric` as RL does."""
    rdrop_alpha: float = Field(0.0, ge=0.0)
    """R-drop weight of the symmetric KL between two dropout passes (0 disables R-drop)."""
    augment_prob: float = Field(0.0, ge=0.0, lt=1.0)
    """Input augmentation: fraction of source tokens deleted or repeated 1-3 times (0 disables)."""
    fgm_epsilon: float = Field(0.0, ge=0.0)
    """FGM adversarial step size on the shared embedding (0 disables)."""
