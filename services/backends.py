"""Inference backends of the policy server: one interface, torch (default) and CTranslate2.

A backend holds one set of weights (one checkpoint) and is never mutated: hot reload builds a new
backend and the batcher swaps the reference between batches. Backend methods are called from the
batcher's single worker thread only (torch is not re-entrant-friendly, and the machines are small),
except ``count_tokens`` and ``check_text``, which the routes call on the event loop (they use a private
copy of the tokenizer).

A model call takes a :class:`StepControl`: the torch backend's sampler asks it between decoding steps
which sources are gone (their rows leave the batch) and lets it run waiting work; its beam search lets
waiting work run between steps too, and stops when every source is gone. CTranslate2 runs a call to the end
(its bound is the call's size).

Log-probs everywhere are of the *raw* model, log-softmax of the logits at temperature 1 without top-k /
top-p filtering: the quantity reranking and the rank loss use, comparable between sampled, beamed and
teacher-forced texts.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlt2t.common.checkpoint import read_checkpoint, resolve_model_dir, weights_checksum
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import Config
from rlt2t.common.ct2 import Ct2Policy, export_ct2, is_export_dir, read_export_info, sample_ct2_logprobs
from rlt2t.common.families import positions_or
from rlt2t.common.policy import Policy, load_policy
from rlt2t.common.sampling import sample_candidates
from rlt2t.common.scoring import token_scores
from rlt2t.common.search import SEARCH_CONTROLS, search_arguments
from rlt2t.common.tokenization import text_checker

log = logging.getLogger("rlt2t.services.backends")


@dataclass(frozen=True)
class Generation:
    """One candidate: generated ids (no decoder start, EOS included when produced), raw log-probs, and the
    log-probs under the distribution each token was drawn from (sampling: temperature, top-k, top-p; beam
    search: the raw ones). ``forced_eos``: the last token is the EOS forced at the length limit."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    forced_eos: bool = False


FILTER_NAMES = {"top_p": ("nucleus", 1.0), "epsilon": ("epsilon", 0.0)}
"""The sampling filters a backend may lack (:meth:`Sampling.filters`), by request field: what they are called, and
the value that switches them off."""


@dataclass(frozen=True)
class Sampling:
    """Decoding settings of one model call (requests are only batched with equal settings)."""

    mode: str = "sample"
    """`sample` or `beam`."""
    num_candidates: int = 1
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    beam_size: int = 4
    max_new_tokens: int = 64
    epsilon: float = 0.0
    no_repeat_ngram_size: int = 0
    """`beam` mode: no n-gram of this many tokens occurs twice in a hypothesis (0: no limit)."""
    repetition_penalty: float = 1.0
    """`beam` mode: the score of a token the hypothesis already holds is divided by this when positive and
    multiplied by it when negative (1: none; CTranslate2 scales the logits, the torch backend the log-probs, as
    transformers does in beam search)."""
    length_penalty: float = 1.0
    """`beam` mode: a finished hypothesis ranks by its log-probability divided by its length to this power (1: the
    mean per token; 0: the sum, which favours short ones; above 1 favours long ones)."""
    min_new_tokens: int = 0
    """`beam` mode: no EOS before this many tokens (0: none)."""

    def filters(self) -> list[str]:
        """The sampling filters these settings switch on beyond top-k and temperature (`top_p`, `epsilon`): what a
        backend without them must refuse."""
        if self.mode != "sample":
            return []
        return [field for field, (_, off) in FILTER_NAMES.items() if getattr(self, field) != off]

    def beam_controls(self) -> list[str]:
        """The beam-search controls these settings switch on (refused with sampling)."""
        return [field for field, off in SEARCH_CONTROLS.items() if getattr(self, field) != off]


@dataclass(frozen=True)
class Scored:
    """Teacher-forced scores of one target: its label ids (the whole target template) and their raw log-probs."""

    token_ids: list[int]
    logprobs: list[float]


class StepControl(Protocol):
    """What the server hands to one model call (``rlt2t.services.batching`` implements it)."""

    def stopped(self) -> Collection[int]:
        """Indices of the call's sources whose request is gone."""
        ...

    def between_steps(self) -> Collection[int]:
        """Called between decoding steps: may run other work, then returns :meth:`stopped`."""
        ...


@runtime_checkable
class PolicyBackend(Protocol):
    """What the policy server needs from an inference engine."""

    name: str
    """Backend kind (`torch`, `ct2`)."""
    version: int
    """Policy version of the loaded weights."""
    checkpoint: str
    """Directory the weights came from."""
    checksum: str
    """sha256 of the weight files."""
    loaded_at: float
    """Unix time of loading."""
    max_positions: int
    """Longest token sequence (source, or decoder input) the model accepts."""
    sampling_filters: frozenset[str]
    """The filters of `sample` mode it has beyond top-k and temperature (of :data:`FILTER_NAMES`)."""

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text without special tokens (what the tokens-per-source limit counts)."""
        ...

    def check_text(self, text: str) -> str | None:
        """The first problem of ``text`` under the tokenizer's token rule (``text_checker``), or None."""
        ...

    def candidates(self, sources: Sequence[str], sampling: Sampling, row_seeds: Sequence[int],
                   control: StepControl | None = None) -> list[list[Generation]]:
        """``sampling.num_candidates`` generations per source. In `sample` mode ``row_seeds`` holds one
        seed per row (row ``i * k + j`` = sample j of source i), each row's randomness coming from its
        seed alone; `beam` mode is deterministic and ignores them. The generations of sources that
        ``control`` reports stopped are cut short (their requests discard them)."""
        ...

    def score(self, sources: Sequence[str], targets: Sequence[Sequence[str]]) -> list[list[Scored]]:
        """Teacher-forced per-token log-probs of ``targets[i][j]`` given ``sources[i]``."""
        ...

    def close(self) -> None:
        """Release what the backend holds on disk (no call may follow)."""
        ...


def load_backend(cfg: Config, model_dir: str | Path) -> PolicyBackend:
    """The ``cfg.serve.backend`` backend for a model or checkpoint directory (the one loading entry point
    of the server and its hot reload)."""
    if cfg.serve.backend == "torch":
        return TorchBackend.from_checkpoint(cfg, model_dir)
    if cfg.serve.backend == "ct2":
        return Ct2Backend.from_checkpoint(cfg, model_dir)
    raise ValueError(f"serve.backend: unknown backend {cfg.serve.backend!r} (supported: torch, ct2)")


def _count_tokens(tokenizer, texts: Sequence[str]) -> list[int]:
    """Tokens per text without special tokens. The Rust tokenizer directly when there is one: the
    Python wrapper's per-call overhead is a visible share of a small request on the event loop."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def checkpoint_version(model_dir: str | Path) -> int:
    """The marker's ``policy_version`` if present, else its ``step``; 0 for a plain model directory."""
    info = read_checkpoint(model_dir)
    if info is None:
        return 0
    version = info.meta.get("policy_version", info.step)
    return int(version)


class TorchBackend:
    """The policy as a Hugging Face BART on torch; see :class:`PolicyBackend`."""

    name = "torch"
    sampling_filters = frozenset({"top_p", "epsilon"})

    def __init__(self, policy: Policy, *, version: int = 0, checkpoint: str = "", checksum: str = "",
                 device: str = "cpu", max_batch_rows: int = 256, max_source_len: int | None = None) -> None:
        self.policy = policy
        self.device = torch.device(device)
        # never dropout at inference; transformers' @wraps(nn.Module.to) makes mypy read .to unbound
        self.model = policy.model.to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = policy.tokenizer
        # The request handlers count tokens on the event loop while the worker encodes: a private copy
        # keeps the Rust tokenizer from being borrowed by two threads at once.
        self._counting_tokenizer = copy.deepcopy(policy.tokenizer)
        self._check_text = text_checker(self._counting_tokenizer)
        self.version = version
        self.checkpoint = checkpoint or policy.origin
        self.checksum = checksum
        self.loaded_at = time.time()
        self.max_positions = positions_or(self.model.config)  # T5: relative positions, no limit
        self.max_batch_rows = max_batch_rows
        # Sources are cut to this many tokens: the model's positions (the server), or training's
        # data.max_source_len (`rlt2t predict` and `eval --rerank`, whose CTranslate2 runner cuts them so too).
        self.source_len = min(max_source_len, self.max_positions) if max_source_len else self.max_positions

    @classmethod
    def from_checkpoint(cls, cfg: Config, path: str | Path, *, device: str | None = None,
                        max_source_len: int | None = None) -> TorchBackend:
        """Load a checkpoint or model directory (or the newest complete checkpoint of a root); ``max_source_len``:
        where sources are cut (None: the model's positions)."""
        model_dir = resolve_model_dir(path)
        policy = load_policy(cfg.model, cfg.tokenizer_dir if cfg.tokenizer_dir.is_dir() else None,
                             checkpoint=model_dir)
        dev = device or cfg.serve.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(policy, version=checkpoint_version(model_dir), checkpoint=str(model_dir),
                   checksum=weights_checksum(model_dir), device=dev, max_source_len=max_source_len)

    # -- interface -----------------------------------------------------------------------------------

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return _count_tokens(self._counting_tokenizer, texts)

    def check_text(self, text: str) -> str | None:
        return self._check_text(text)

    def close(self) -> None:
        """Nothing on disk to release."""

    def candidates(self, sources: Sequence[str], sampling: Sampling, row_seeds: Sequence[int],
                   control: StepControl | None = None) -> list[list[Generation]]:
        if sampling.mode == "beam":
            return self._beam(sources, sampling, control)
        if sampling.mode != "sample":
            raise ValueError(f"sampling.mode must be 'sample' or 'beam', got {sampling.mode!r}")
        _refuse_beam_controls(sampling)
        k = sampling.num_candidates
        if len(row_seeds) != len(sources) * k:
            raise ValueError(f"row_seeds: need one per row ({len(sources)} x {k}), got {len(row_seeds)}")
        generators = [torch.Generator(device=self.device).manual_seed(s) for s in row_seeds]
        ids, _ = encode_texts(self.tokenizer, sources, self.source_len)
        batch = collate_seq2seq(ids, None, self.tokenizer.pad_token_id)
        between = None
        if control is not None:
            def between() -> set[int]:  # sources gone -> their k rows
                return {i * k + j for i in control.between_steps() for j in range(k)}
        rows = sample_candidates(self.model, batch["input_ids"], batch["attention_mask"], k, sampling.top_k,
                                 sampling.temperature, sampling.max_new_tokens, generators, top_p=sampling.top_p,
                                 epsilon=sampling.epsilon,
                                 between_steps=between)
        texts = self.policy.decode([r.token_ids for r in rows]) if rows else []
        flat = [Generation(text, r.token_ids, r.logprobs, r.sample_logprobs, r.forced)
                for text, r in zip(texts, rows, strict=True)]
        return [flat[i * k : (i + 1) * k] for i in range(len(sources))]

    def score(self, sources: Sequence[str], targets: Sequence[Sequence[str]]) -> list[list[Scored]]:
        if len(targets) != len(sources):
            raise ValueError(f"targets: need one list per source ({len(sources)}), got {len(targets)}")
        src_ids, _ = encode_texts(self.tokenizer, sources, self.source_len)
        out: list[list[Scored]] = []
        for i, ts in enumerate(targets):
            label_ids, _ = encode_texts(self.tokenizer, ts, self.max_positions, target=True)
            lps = self.teacher_forced([src_ids[i]] * len(label_ids), label_ids)
            out.append([Scored(lab, lp) for lab, lp in zip(label_ids, lps, strict=True)])
        return out

    # -- torch work ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def teacher_forced(self, sources: Sequence[Sequence[int]], labels: Sequence[Sequence[int]]) -> list[list[float]]:
        """Raw log-prob of every label id given its source: sources/labels are lists of id lists [N]."""
        out: list[list[float]] = []
        pad_id = self.tokenizer.pad_token_id
        start_id = self.model.config.decoder_start_token_id
        for first in range(0, len(labels), self.max_batch_rows):
            src, lab = sources[first : first + self.max_batch_rows], labels[first : first + self.max_batch_rows]
            batch = collate_seq2seq(src, lab, pad_id)
            label_t = batch["labels"].to(self.device)
            decoder_in = torch.full_like(label_t, pad_id)
            decoder_in[:, 0] = start_id
            decoder_in[:, 1:] = label_t[:, :-1].clamp(min=0).masked_fill(label_t[:, :-1] < 0, pad_id)
            logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                attention_mask=batch["attention_mask"].to(self.device),
                                decoder_input_ids=decoder_in).logits
            scores = token_scores(logits, label_t, "logprobs").cpu()
            out += [scores[r, : len(lab[r])].tolist() for r in range(len(lab))]
        return out

    def _beam(self, sources: Sequence[str], sampling: Sampling, control: StepControl | None = None
              ) -> list[list[Generation]]:
        """Beam search via ``generate``; per-token log-probs recomputed by teacher forcing (exact, raw).
        Stops early when ``control`` reports every source stopped."""
        if sampling.num_candidates > sampling.beam_size:
            raise ValueError(f"num_candidates={sampling.num_candidates} exceeds beam_size={sampling.beam_size}")
        ids, _ = encode_texts(self.tokenizer, sources, self.source_len)
        batch = collate_seq2seq(ids, None, self.tokenizer.pad_token_id)
        h = sampling.num_candidates
        settings, processors = search_arguments(**{key: getattr(sampling, key) for key in SEARCH_CONTROLS})
        with torch.inference_mode():
            gen = self.model.generate(
                input_ids=batch["input_ids"].to(self.device), attention_mask=batch["attention_mask"].to(self.device),
                num_beams=sampling.beam_size, num_return_sequences=h, max_new_tokens=sampling.max_new_tokens,
                do_sample=False, early_stopping=True, **settings, logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([_AllStopped(control, len(sources))] if control else []),
            ).cpu()
        pad_id, eos_id = self.tokenizer.pad_token_id, self.model.config.eos_token_id
        rows: list[list[int]] = []
        for seq in gen.tolist():
            seq = seq[1:]  # drop the decoder start token
            if eos_id in seq:
                seq = seq[: seq.index(eos_id) + 1]
            else:
                while seq and seq[-1] == pad_id:
                    seq.pop()
            rows.append(seq)
        lps = self.teacher_forced([ids[r // h] for r in range(len(rows))], rows)
        texts = self.policy.decode(rows)
        flat = [Generation(t, r, lp, lp) for t, r, lp in zip(texts, rows, lps, strict=True)]
        return [flat[i * h : (i + 1) * h] for i in range(len(sources))]


def _refuse_beam_controls(sampling: Sampling) -> None:
    """Samples are drawn from the model's own distribution (what RL's ratios and MBR's expectation assume): the
    repetition and length controls are beam search's."""
    if fields := sampling.beam_controls():
        name = fields[0]
        raise ValueError(f"{name}={getattr(sampling, name)}: applies to beam search only (samples are drawn from the "
                         f"model's distribution); leave it at {SEARCH_CONTROLS[name]:g} when sampling")


class _AllStopped(StoppingCriteria):
    """Called by ``generate`` after each decoding step: lets waiting work run (``between_steps``), and stops
    once every source of the call is stopped (beams of one source cannot leave alone)."""

    def __init__(self, control: StepControl, num_sources: int) -> None:
        self.control, self.num_sources = control, num_sources

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = len(set(self.control.between_steps())) >= self.num_sources
        # a bool tensor is what transformers' BoolTensor annotation means; torch.full is annotated Tensor
        stop = torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
        return cast(torch.BoolTensor, stop)


class Ct2Backend:
    """The policy as a CTranslate2 export; see :class:`PolicyBackend`.

    A checkpoint (or plain model directory) is exported to a private temporary directory at load, with
    ``export.quantization``; an ``rlt2t export`` directory is served as it is (version 0: exports carry
    no policy version). Differences from the torch backend, both CTranslate2 limits: sampling is seeded
    per model call, not per row (the same request alone gives the same candidates; batched with others
    it may not), and there is no top-p or epsilon filter (a request with ``top_p < 1`` or ``epsilon > 0`` is refused
    with a 422).
    Log-probs are recomputed by teacher forcing (``score_batch``): raw, as everywhere.
    """

    name = "ct2"
    sampling_filters: frozenset[str] = frozenset({"top_p"})

    def __init__(self, ct2, *, version: int = 0, checkpoint: str = "", checksum: str = "", workdir=None) -> None:
        self.ct2 = ct2
        self.tokenizer = ct2.tokenizer
        self._counting_tokenizer = copy.deepcopy(ct2.tokenizer)  # see TorchBackend
        self._check_text = text_checker(self._counting_tokenizer)
        self.version = version
        self.checkpoint = checkpoint or str(ct2.export_dir)
        self.checksum = checksum
        self.loaded_at = time.time()
        self.max_positions = int(ct2.max_target_len)  # the model's positions (a source may be cut shorter)
        self._workdir = workdir  # a TemporaryDirectory holding the export; removed with the backend

    @classmethod
    def from_checkpoint(cls, cfg: Config, path: str | Path) -> Ct2Backend:
        import tempfile


        threads = cfg.export.threads
        if is_export_dir(path):
            info = read_export_info(path)
            return cls(Ct2Policy(path, intra_threads=threads), checkpoint=str(path),
                       checksum=str(info.get("checksum", info.get("source_sha256", ""))))
        model_dir = resolve_model_dir(path)
        workdir = tempfile.TemporaryDirectory(prefix="rlt2t-serve-ct2-")
        out = export_ct2(model_dir, Path(workdir.name) / "model", cfg.export.quantization,
                         tokenizer_dir=cfg.tokenizer_dir if cfg.tokenizer_dir.is_dir() else None)
        return cls(Ct2Policy(out, intra_threads=threads), version=checkpoint_version(model_dir),
                   checkpoint=str(model_dir), checksum=weights_checksum(model_dir), workdir=workdir)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return _count_tokens(self._counting_tokenizer, texts)

    def check_text(self, text: str) -> str | None:
        return self._check_text(text)

    def close(self) -> None:
        """Remove the export this backend made (the translator already holds the model in memory). Also
        done when the backend is garbage-collected; this makes it happen before a process is killed."""
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def candidates(self, sources: Sequence[str], sampling: Sampling, row_seeds: Sequence[int],
                   control: StepControl | None = None) -> list[list[Generation]]:
        k = sampling.num_candidates  # `control` unused: a CTranslate2 call runs to its end
        if sampling.mode == "beam":
            hyps = self.ct2.generate(sources, beam_size=sampling.beam_size, num_hypotheses=k,
                                     max_new_tokens=sampling.max_new_tokens,
                                     no_repeat_ngram_size=sampling.no_repeat_ngram_size,
                                     repetition_penalty=sampling.repetition_penalty,
                                     length_penalty=sampling.length_penalty, min_new_tokens=sampling.min_new_tokens)
            rows = [list(h.token_ids) for per_source in hyps for h in per_source]
            texts = [h.text for per_source in hyps for h in per_source]
            sample_lps: list[list[float] | None] = [None] * len(rows)
            forced = [False] * len(rows)
        elif sampling.mode == "sample":
            _refuse_beam_controls(sampling)
            if unsupported := [f for f in sampling.filters() if f not in self.sampling_filters]:
                raise ValueError(f"{unsupported[0]}: the ct2 backend has no {FILTER_NAMES[unsupported[0]][0]} sampling")
            seed = int.from_bytes(hashlib.sha256(repr(tuple(row_seeds)).encode()).digest()[:4], "little")
            sampled = sample_ct2_logprobs(self.ct2, sources, k, sampling.top_k, sampling.temperature,
                                          sampling.max_new_tokens, seed, top_p=sampling.top_p)
            rows = [r.token_ids for r in sampled]
            texts = [" ".join(t.split()) for t in self.tokenizer.batch_decode(rows, skip_special_tokens=True)]
            sample_lps = [r.sample_logprobs for r in sampled]
            forced = [r.forced for r in sampled]
        else:
            raise ValueError(f"sampling.mode must be 'sample' or 'beam', got {sampling.mode!r}")
        srcs = [sources[r // k] for r in range(len(rows))]
        lps = self._teacher_forced(srcs, rows)  # raw log-probs, as everywhere (the forced EOS's included)
        gens = [Generation(t, row, lp, slp if slp is not None else lp, f)
                for t, row, lp, slp, f in zip(texts, rows, lps, sample_lps, forced, strict=True)]
        return [gens[i * k : (i + 1) * k] for i in range(len(sources))]

    def score(self, sources: Sequence[str], targets: Sequence[Sequence[str]]) -> list[list[Scored]]:
        if len(targets) != len(sources):
            raise ValueError(f"targets: need one list per source ({len(sources)}), got {len(targets)}")
        out: list[list[Scored]] = []
        for source, ts in zip(sources, targets, strict=True):
            # the training labels of each target (its whole target template), one log-prob per id, as torch's
            lps = self.ct2.score([source] * len(ts), list(ts))
            out.append([Scored(x, lp) for x, lp in zip(self.ct2.target_ids(list(ts)), lps, strict=True)])
        return out

    def _teacher_forced(self, sources: Sequence[str], rows: Sequence[Sequence[int]]) -> list[list[float]]:
        """Raw log-probs of generated id rows (:meth:`Ct2Policy.score_ids`)."""
        return self.ct2.score_ids(sources, rows)
