"""Decoding a split and scoring it: the metric table of `rlt2t eval` and the per-epoch monitor.

Text metrics come from the registry of ``rlt2t.common.metrics``; the one metric that needs the model itself,
the perplexity of the references (:func:`reference_perplexity`, teacher forcing), is computed here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import (
    MONITOR_OVER_HTTP,
    Config,
    ConfigError,
    EvalConfig,
    MetricConfig,
    did_you_mean,
)
from rlt2t.common.data import Example, references_of
from rlt2t.common.families import decoder_input_ids, generation_config, positions_or
from rlt2t.common.metrics import available_metrics, get_metric, metric_params, missing_dependency, user_metrics
from rlt2t.common.plugins import load_plugins
from rlt2t.common.policy import Policy
from rlt2t.common.python_rewards import RewardError
from rlt2t.common.scoring import token_scores
from rlt2t.common.search import search_arguments

TABLE_METRICS = ("cider_d", "bleu4", "task_score", "rouge_l", "mean_length")
MODEL_METRICS = ("perplexity",)
"""Eval-table columns computed from the model rather than from the decoded text."""
REWARD_COLUMN = "reward"
"""Eval-table column: the mean of the run's reward (``reward.terms``) over the outputs, as RL scores its samples
(each with its row's references and fields)."""
MODEL_COLUMNS = (*MODEL_METRICS, "classifier_accuracy", REWARD_COLUMN)
"""Columns that need a model, a classifier or the reward besides the texts and references: left out where only
texts are."""
LENGTHS = ("mean_length", "max_length")
"""Metrics that measure length, not quality: refused as the validation monitor."""


@torch.no_grad()
def generate(policy: Policy, sources: Sequence[str], *, num_beams: int = 1, max_new_tokens: int = 64,
             batch_size: int = 64, max_source_len: int = 128, progress: bool = False,
             controls: Mapping[str, Any] | None = None) -> list[str]:
    """Greedy (num_beams=1) or beam decoding of ``sources``; returns texts in input order.

    Sources are batched by length (less padding), results put back in order. Decoding uses a fresh generation
    config (``families.generation_config``): the model's special ids and these arguments, nothing else;
    ``controls``, the search's repetition and length controls by name (:func:`rlt2t.common.search.search_arguments`;
    none: off).
    """
    model = policy.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # generate is untyped here: PreTrainedModel does not declare it (each seq2seq LM class mixes it in, and
    # transformers types it against its own protocol of the host model); peft's wrapper forwards it.
    generator: Any = model
    ids, _ = encode_texts(policy.tokenizer, sources, max_source_len)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[str] = [""] * len(ids)
    pad_id = policy.tokenizer.pad_token_id
    # Only the family's special ids and these settings: what a loaded generation_config.json adds
    # (no_repeat_ngram_size, min_length, length_penalty, ...) the RL sampler ignores, and so does this.
    search, processors = search_arguments(**(controls or {}))
    settings = generation_config(generator.generation_config, num_beams=num_beams, max_new_tokens=max_new_tokens,
                                 do_sample=False, early_stopping=num_beams > 1, **search)
    # on a terminal only (disable=None): a log file would get a carriage-return line per update
    for start in tqdm(range(0, len(order), batch_size), desc="decode", disable=None if progress else True,
                      leave=False):
        chunk = order[start : start + batch_size]
        batch = collate_seq2seq([ids[i] for i in chunk], None, pad_id)
        gen = generator.generate(
            input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
            generation_config=settings, logits_processor=processors,
        )
        for i, text in zip(chunk, policy.decode(gen), strict=True):
            out[i] = text
    model.train(was_training)
    return out


def check_metric_names(names: Sequence[str], what: str = "eval.metrics") -> list[str]:
    """``names`` as a list, or ValueError naming ``what`` and the known names for an unknown or repeated one."""
    if isinstance(names, str):
        raise TypeError(f"{what} must be a list of metric names, got one str")
    known = [*available_metrics(), *MODEL_METRICS, REWARD_COLUMN]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown metric(s) {unknown}; known: {', '.join(known)}")
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"{what}: give each metric once and at least one, got {list(names)}")
    return list(names)


def validation_columns(eval_metrics: Sequence[str]) -> list[str]:
    """The columns of RL's validation table, which the learner ranks compute: ``TABLE_METRICS``, then the
    built-in text metrics of ``eval_metrics`` (``eval.metrics``: chrF, sacreBLEU, ...) beyond them that run on
    this machine. ``eval.metrics`` is `rlt2t eval`'s, which checks every name: what a rank cannot compute (a
    column that needs a model, a metric of the user's, one missing its data) is left out here, not refused."""
    builtin = set(available_metrics()) - set(user_metrics())  # a rank is a fresh process: the built-in ones
    return [*TABLE_METRICS, *(n for n in dict.fromkeys(eval_metrics) if n in builtin
                              and n not in (*TABLE_METRICS, *MODEL_COLUMNS) and missing_dependency(n) is None)]


def metric_table(hyps: Sequence[str], refs: Sequence[Sequence[str]], metric: MetricConfig,
                 names: Sequence[str] = TABLE_METRICS,
                 params: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, float]:
    """Corpus values of the text metrics ``names`` (default: CIDEr-D, BLEU-4, task score, ROUGE-L, mean
    length), in that order; ``params`` adds keyword parameters per metric (e.g. the classifier's path)."""
    params = params or {}
    return {name: get_metric(name, **metric_params(name, metric), **params.get(name, {})).corpus(hyps, refs)
            for name in names}


def distinct_outputs(sources: Sequence[str], texts: Sequence[str]) -> float:
    """Distinct texts per distinct source: 1.0 when every source has a text of its own, 1/n when n sources share
    one. A source that repeats counts once, with its first text."""
    first: dict[str, str] = {}
    for source, text in zip(sources, texts, strict=True):
        first.setdefault(source, text)
    return len(set(first.values())) / max(len(first), 1)


COLLAPSE_RATIO = 0.05
"""Greedy outputs this much less varied than the references (distinct outputs per distinct source) mean a
decoder that writes the same few texts whatever its source. A collapsed SFT run gave 0.01 of its references'
variety (2 texts for 200 sources); the CPU demo's short SFT keeps about 0.2, and its RL dips to 0.1 at the first
epoch before recovering: a twentieth flags the first and not the second."""
COLLAPSE_MIN_SOURCES = 20


def collapse_reference(examples: Sequence[Example]) -> float | None:
    """The references' own ``distinct_outputs`` (each example's first reference), the variety a model's greedy
    outputs are compared with; None when too few distinct sources (``COLLAPSE_MIN_SOURCES``) or references
    are missing, where no collapse is judged."""
    sources = [e.source for e in examples]
    if len(set(sources)) < COLLAPSE_MIN_SOURCES or not all(e.refs for e in examples):
        return None
    return distinct_outputs(sources, [e.refs[0] for e in examples])


def collapse_warning(what: str, distinct: float, examples: Sequence[Example], advice: str) -> str | None:
    """A warning when ``distinct`` (:func:`distinct_outputs` of a model's greedy outputs on ``examples``) is below
    ``COLLAPSE_RATIO`` of the references' own (each example's first reference), over at least
    ``COLLAPSE_MIN_SOURCES`` distinct sources, or when one text answers every source while the references hold
    20 texts or more; None otherwise. A task whose targets are few (labels) keeps few outputs and is not warned
    about."""
    reference = collapse_reference(examples)
    if reference is None:
        return None
    n = len({e.source for e in examples})
    # One text for every source where the references hold a twentieth's worth (20 texts or more) is the collapse
    # the ratio misses at its boundary (20 sources: 1/20 is not below 0.05 x 1.0).
    one_text = round(distinct * n) <= 1 and round(reference * n) * COLLAPSE_RATIO >= 1
    if distinct >= COLLAPSE_RATIO * reference and not one_text:
        return None
    return (f"{what}: the greedy outputs on {n} validation sources hold {distinct * n:.0f} distinct texts "
            f"(distinct_outputs={distinct:.3f}; the references {reference:.3f}): the decoder writes nearly the same "
            f"text whatever the source; {advice}")


@torch.no_grad()
def reference_perplexity(policy: Policy, sources: Sequence[str], targets: Sequence[str], *, batch_size: int = 64,
                         max_source_len: int = 128, max_target_len: int | None = None) -> float:
    """Perplexity of the references under the model, with teacher forcing: exp(Σ NLL / Σ tokens).

    Corpus-level and token-weighted (every target token counts once, EOS included; sources and targets are
    tokenised and fed as in training: targets cut at ``max_target_len`` (``data.max_target_len``; default the
    model's positions, if it has a limit), decoder inputs from ``families.decoder_input_ids``): the
    exponential of the mean cross-entropy over all reference tokens, not a mean of per-sentence perplexities.
    Lower is better; it says how likely the model finds the gold outputs, which RL moving away from the
    reference distribution raises (the seeds' DailyDialog table: 40.91 supervised, 44.03 after PPO).
    """
    if len(sources) != len(targets) or not sources:
        raise ValueError(f"need as many targets as sources and at least one: {len(sources)} vs {len(targets)}")
    model = policy.model
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tok = policy.tokenizer
    src, _ = encode_texts(tok, sources, max_source_len)
    tgt, _ = encode_texts(tok, targets, max_target_len or positions_or(model.config), target=True)
    nll, count = 0.0, 0
    for start in range(0, len(src), batch_size):
        batch = collate_seq2seq(src[start : start + batch_size], tgt[start : start + batch_size], tok.pad_token_id)
        # The decoder inputs of training, not the model's own shift of the labels (mBART's starts from the
        # last label token, the language code, rather than the decoder start).
        batch["decoder_input_ids"] = decoder_input_ids(batch["labels"], model.config)
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch).logits  # [B, T, V]
        scores = token_scores(logits, batch["labels"], "logprobs")  # [B, T], 0 at padding
        nll -= float(scores.double().sum())
        count += int((batch["labels"] != -100).sum())
    model.train(was_training)
    return math.exp(nll / count)


@dataclass
class EvalResult:
    metrics: dict[str, float]
    predictions: list[str]


def classifier_params(cfg: EvalConfig, examples: Sequence[Example]) -> dict[str, Any]:
    """Parameters of the `classifier_accuracy` column: the classifier directory and, with
    ``eval.classifier_label_field``, each example's expected label (a missing one names the example)."""
    if cfg.classifier_path is None:
        raise ValueError("the classifier_accuracy column needs eval.classifier_path (a sequence-classification "
                         "model directory)")
    params: dict[str, Any] = {"path": cfg.classifier_path, "batch_size": cfg.batch_size}
    field = cfg.classifier_label_field
    if field is not None:
        missing = [e.id for e in examples if field not in e.extra]
        if missing:
            raise ValueError(f"eval.classifier_label_field={field!r}: examples {missing[:5]} have no such field")
        params["labels"] = [e.extra[field] for e in examples]
    return params


def evaluate(policy: Policy, examples: Sequence[Example], cfg: EvalConfig, metric: MetricConfig,
             max_source_len: int, progress: bool = False, *, max_target_len: int | None = None,
             predictions: Sequence[str] | None = None, reward: RewardScores | None = None) -> EvalResult:
    """Decode ``examples`` with the policy and score against their references (``Example.refs``): the columns
    ``cfg.metrics``; the ``reward`` column is the mean of ``reward`` (the run's, :data:`REWARD_COLUMN`).

    ``max_target_len`` (``data.max_target_len``) cuts the references of the perplexity column as training cut
    its targets; None: the model's position limit. ``predictions``: the outputs, one per example, decoded
    elsewhere (a reranked pool: ``eval.rerank``), scored instead of decoding with ``cfg.num_beams``."""
    if cfg.limit:
        examples = examples[: cfg.limit]
    targets = [e.target for e in examples if e.target is not None]
    if len(targets) != len(examples):
        raise ValueError("evaluation needs targets; this split has unlabeled examples (use `rlt2t predict`)")
    names = check_metric_names(cfg.metrics)
    if predictions is not None:
        if len(predictions) != len(examples):
            raise ValueError(f"predictions: {len(predictions)} for {len(examples)} examples")
        hyps = list(predictions)
    else:
        hyps = generate(policy, [e.source for e in examples], num_beams=cfg.num_beams,
                        max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, max_source_len=max_source_len,
                        progress=progress, controls=cfg.search_controls())
    text_names = [n for n in names if n not in (*MODEL_METRICS, REWARD_COLUMN)]
    params = {"classifier_accuracy": classifier_params(cfg, examples)} if "classifier_accuracy" in names else {}
    values = metric_table(hyps, references_of(examples, "evaluation"), metric, text_names, params)
    if REWARD_COLUMN in names:
        if reward is None:
            raise ValueError("the reward column needs the run's reward to score with (eval_job builds it from "
                             "reward.terms)")
        try:
            values[REWARD_COLUMN] = float(np.mean(reward([e.source for e in examples], hyps,
                                                         [list(e.refs) for e in examples],
                                                         [e.extra for e in examples])))
        except RewardError as e:  # the user's function, on an evaluated output: said as in training
            raise RewardError(f"the eval table's reward column: {e}") from None
    if "perplexity" in names:
        values["perplexity"] = reference_perplexity(policy, [e.source for e in examples], targets,
                                                    batch_size=cfg.batch_size,
                                                    max_source_len=max_source_len, max_target_len=max_target_len)
    return EvalResult({n: values[n] for n in names}, hyps)


Monitor = Callable[[Sequence[Example], Sequence[str]], float]
"""The validation monitor's value of greedy outputs (one per example, in order): higher is better."""
RewardScores = Callable[[Sequence[str], Sequence[str], Sequence[Sequence[str]], Sequence[Mapping[str, Any]]],
                        "Sequence[float] | np.ndarray"]
"""The job's reward of (sources, candidates, references, row fields): one score per candidate."""


def monitor_name(metric: MetricConfig) -> str:
    """What ``metric.monitor`` measures, as logs and checkpoint meta name it: the name, and the settings it is
    scored with where they differ from their defaults (``default, monitor_bleu_weight=0.5``; ``cider_d,
    cider_sigma=15``): a best chosen with other settings does not compare. A reward's terms are not named."""
    if metric.monitor == "default":
        settings = {"monitor_bleu_weight": metric.monitor_bleu_weight, "cider_sigma": metric.cider_sigma}
    else:
        keys = {"sigma": "cider_sigma", "bleu_weight": "bleu_weight"}
        settings = {keys[k]: getattr(metric, keys[k]) for k in metric_params(metric.monitor, metric) if k in keys}
    defaults = MetricConfig()
    changed = [f"{k}={v:g}" for k, v in settings.items() if v != getattr(defaults, k)]
    return ", ".join([metric.monitor, *changed])


def build_monitor(metric: MetricConfig, reward: Callable[[], RewardScores] | None = None,
                  plugins: Sequence[str] = ()) -> Monitor:
    """``metric.monitor`` as a function of the validation examples and their greedy outputs: ``default``,
    (1-w)·CIDEr-D + w·BLEU-4 with w = ``metric.monitor_bleu_weight``; a registered metric's corpus value with its
    configured parameters (:func:`metric_params`); or ``reward``, the mean of the job's reward, which ``reward``
    builds (called only for that one: it may load reward models). Built when a job starts, so that an unknown
    name or a metric that cannot be built fails before training, as a ConfigError naming ``metric.monitor``.
    ``plugins`` (``reward.plugins``) are imported first, with the installed plugin entry points."""
    name = metric.monitor
    if name == "reward":
        if reward is None:
            raise ConfigError("metric.monitor=reward: this job has no reward to score with; name a metric")
        scores = reward()

        def mean_reward(examples: Sequence[Example], hyps: Sequence[str]) -> float:
            try:
                return float(np.mean(scores([e.source for e in examples], hyps, [list(e.refs) for e in examples],
                                            [e.extra for e in examples])))
            except RewardError as e:  # the user's function, on a validation output: said as in training
                raise RewardError(f"the validation monitor (metric.monitor=reward): {e}") from None

        return mean_reward
    if name in LENGTHS:
        raise ConfigError(f"metric.monitor={name}: a length, not a score (the longest outputs would be kept); "
                          "name a metric")
    if name == "default":
        scorer = get_metric("task_score", bleu_weight=metric.monitor_bleu_weight, sigma=metric.cider_sigma)
    else:
        load_plugins(plugins, "reward.plugins")
        known = available_metrics()
        if name not in known:
            hint = did_you_mean(name, [*known, "default", "reward"], cutoff=0.6)
            raise ConfigError(f"metric.monitor: unknown metric {name!r}{hint}; known: default, reward, "
                              f"{', '.join(known)} (a metric of your own: register it in a module listed in "
                              "reward.plugins)")
        params = metric_params(name, metric)
        if missing := missing_dependency(name, **params):
            raise ConfigError(f"metric.monitor={name}: {missing}")
        try:
            scorer = get_metric(name, **params)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"metric.monitor={name}: the metric cannot be built from the config alone ({e}); "
                              "name another metric") from e
    return lambda examples, hyps: scorer.corpus(hyps, [list(e.refs) for e in examples])


def job_monitor(cfg: Config, reward: Callable[[], RewardScores] | None = None) -> Monitor:
    """A job's :func:`build_monitor` (``reward.plugins`` imported; ``reward`` builds the job's reward for
    ``metric.monitor=reward``), refusing a reward monitor beside a reward server even when the config was changed
    after it loaded (assigning ``cfg.metric.monitor`` skips the config's cross-section check)."""
    if cfg.metric.monitor == "reward" and cfg.reward.source == "http":
        raise ConfigError(MONITOR_OVER_HTTP)
    return build_monitor(cfg.metric, reward, cfg.reward.plugins)


def monitor_score(policy: Policy, examples: Sequence[Example], metric: MetricConfig, *, max_source_len: int,
                  max_new_tokens: int, batch_size: int = 64, by: str = "metric",
                  max_target_len: int | None = None, monitor: Monitor | None = None) -> dict[str, float]:
    """The validation monitor: greedy decoding scored by ``monitor`` (default :func:`build_monitor` of
    ``metric``), with CIDEr-D alone and the outputs' variety (:func:`distinct_outputs`, which shows a decoder
    that ignores its source). ``by="loss"``: the monitor is instead minus ``valid_loss``, the references' mean
    cross-entropy per token under teacher forcing (the log of :func:`reference_perplexity`; targets cut at
    ``max_target_len`` as training cut them), so that a higher monitor is still better; the metric's value is
    logged as ``metric``."""
    if by not in ("metric", "loss"):
        raise ValueError(f"monitor must be 'metric' or 'loss', got {by!r}")
    refs = references_of(examples, "the validation monitor")
    sources = [e.source for e in examples]
    hyps = generate(policy, sources, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    max_source_len=max_source_len)
    out = {"monitor": (monitor or build_monitor(metric))(examples, hyps),
           "cider_d": get_metric("cider_d", sigma=metric.cider_sigma).corpus(hyps, refs),
           "distinct_outputs": distinct_outputs(sources, hyps)}
    if by == "loss":
        targets = [e.target for e in examples if e.target is not None]  # every one (references_of checked)
        loss = math.log(reference_perplexity(policy, sources, targets, batch_size=batch_size,
                                             max_source_len=max_source_len, max_target_len=max_target_len))
        out = {**out, "metric": out["monitor"], "valid_loss": loss, "monitor": -loss}
    return out
