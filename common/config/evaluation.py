"""`eval` and `metric`: how checkpoints are evaluated and the task metric's settings."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from rlt2t.common.config.base import _Section
from rlt2t.common.config.services import PredictRerank, SearchControls


class EvalConfig(SearchControls):
    """`rlt2t eval`: its decode (`num_beams`, `max_new_tokens` and the search controls `no_repeat_ngram_size`,
    `repetition_penalty`, `length_penalty`, `min_new_tokens`; a reranked pool takes `predict`'s instead) and its
    table. The validation monitors of training decode greedily without the controls."""

    split: Literal["train", "valid", "test"] = "valid"
    """Split decoded by `rlt2t eval`."""
    num_beams: int = Field(1, ge=1)
    """1 = greedy decoding."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest generated target (left unset, at most 4x data.max_target_len)."""
    batch_size: int = Field(64, ge=1)
    """Sources per generate call."""
    limit: int = Field(0, ge=0)
    """Evaluate only the first N examples (0: all)."""
    metrics: list[str] = ["cider_d", "bleu4", "task_score", "rouge_l", "mean_length"]  # pydantic copies the default
    """Columns of the eval table: registered metric names (rouge1, meteor, sacrebleu, distinct_2, ...),
    `perplexity` (of the references under the model) and `reward` (the mean of reward.terms over the outputs);
    `rlt2t eval --metrics` overrides it."""
    classifier_path: str | None = None
    """Sequence-classification model directory for the `classifier_accuracy` column, or a checkpoint root of one
    (its best, else newest, complete checkpoint; `{run}` expands)."""
    classifier_label_field: str | None = None
    """JSONL field holding each example's expected class (e.g. `intent`); None: the classifier's label of the
    reference is expected."""
    rerank: Literal["none", PredictRerank] = "none"
    """`none`: decode with `num_beams` (1: greedy); otherwise pick from a pool of candidates as `rlt2t predict`
    does (the model generates and scores; predict.pool, predict.beam_size, predict.mbr_utility, ... configure it);
    `rlt2t eval --rerank` overrides it."""

    @model_validator(mode="after")
    def _lengths(self) -> EvalConfig:
        self._check_controls("eval", self.max_new_tokens, beam=("num_beams", self.num_beams), no_search=None)
        return self


class MetricConfig(_Section):
    cider_sigma: float = Field(6.0, gt=0.0)
    """σ of CIDEr-D's Gaussian length penalty (6 is standard; the original used 15), of evaluation and, unless
    `reward.cider_sigma` is set, of the rewards."""
    bleu_weight: float = Field(1 / 3, ge=0.0, le=1.0)
    """w in the task score (1-w)·CIDEr-D + w·BLEU-4 of eval tables and, unless `reward.bleu_weight` is set, of
    the rewards (the competition's 1/3)."""
    monitor: str = Field("default", min_length=1)
    """What picks the best checkpoint of RL (and of an SFT stage with `sft.monitor=metric`), scored each epoch on
    the greedy outputs of `monitor_size` validation examples, higher is better: `default`, (1-w)·CIDEr-D +
    w·BLEU-4 with w = `monitor_bleu_weight` (CIDEr-D alone unless set, as the original); the name of a registered
    metric (`task_score`, `rouge_l`, `sacrebleu`, `chrf`, `meteor`, ..., or one of your own registered in a
    module listed in `reward.plugins`), with its settings here (`cider_sigma`, `bleu_weight`); or `reward`, the
    mean reward of `reward.terms` (Python functions and reward models included, with each row's fields), scored
    as training scores it. Not `mean_length` / `max_length`. The job checks the name before it trains."""
    monitor_bleu_weight: float = Field(0.0, ge=0.0, le=1.0)
    """w of the `default` validation monitor (0, as the original)."""
    monitor_size: int = Field(600, ge=0)
    """Validation examples decoded after each epoch for the monitor (0: none). On 200 rows the demo's greedy
    metric swung by a fifth from epoch to epoch."""
