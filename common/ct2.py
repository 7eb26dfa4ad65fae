"""CTranslate2 export and inference: the int8 path of docs/design.md ("The method", steps 6-7) and the `ct2`
rollout sampler.

An export directory is what CTranslate2's ``TransformersConverter`` writes (``model.bin``,
``shared_vocabulary.json``, ``config.json``) plus our tokenizer and ``rlt2t_export.json`` (source,
quantization, checksum of the source weights, vocabulary size, special ids)::

    export_ct2("runs/demo/sft/checkpoints/epoch-0004", "runs/demo/export/epoch-0004", "int8")
    ct2 = Ct2Policy("runs/demo/export/epoch-0004")
    ct2.generate(["12 7 <sep> 5 6"], beam_size=4, num_hypotheses=2)   # -> [[Hypothesis, Hypothesis]]
    ct2.score(["12 7 <sep> 5 6"], ["40 41"])                           # -> [[lp("40"), lp("41"), lp(</s>)]]

Every family CTranslate2's converter accepts is exported: BART, mBART, Marian, Pegasus, T5 / mT5 / UMT5
(rlt2t.common.families); a warm-started EncoderDecoderModel is refused with UnsupportedModelError (the torch
backend serves it). The stock loaders are used with three adjustments so that CT2 decodes what the Hugging
Face model decodes: the decoder starts from ``config.decoder_start_token_id`` for every family (mBART's
loader would expect a language-code prefix, Marian's a zero vector instead of the ``<pad>`` row); every
embedding row gets a token name (placeholders for rows the tokenizer does not name, where the stock loaders
cut, duplicate or drop rows); T5's output scaling follows ``config.scale_decoder_outputs``.

Conventions that make CT2 agree with Hugging Face token for token (checked per family by
tests/unit/common/test_ct2.py and test_ct2_families.py):

- sources are our tokenizer's tokens *including* its special tokens (the trailing ``</s>``, mBART's language
  code; the converter sets ``add_source_eos: false``, so CT2 adds nothing); decoding starts from
  ``decoder_start_token``, as ``generate`` does;
- a target is scored as the sequence training labels hold for it: the tokenizer's full target template
  (``encode_texts(tok, [target], ..., target=True)``: ``text </s>`` for ours, ``<s> text </s>`` for BART's
  pretrained tokenizer, ``text </s> tgt_lang`` for mBART with a target language). ``score_batch`` gets those ids
  without a final EOS and appends the EOS itself, so :meth:`Ct2Policy.score` returns one log-prob per label,
  what HF teacher forcing gives over those labels;
- HF ends a row that reaches ``max_new_tokens`` with ``forced_eos_token_id`` (BART's generation config
  sets it); CT2 has no such option, so we decode one token less and append the EOS ourselves. For greedy
  decoding and sampling this is exactly what ``generate`` does; for beam search it is an approximation
  (HF scores beams with the forced EOS in place).

Sampling randomness: CT2 4.8 has no per-call seed (no ``sampling_seed``); ``ctranslate2.set_random_seed``
sets a process-wide seed that each translator worker thread reads once, when it first samples. A seeded
call therefore rebuilds the translator (about a millisecond; the weights stay in memory) right after
setting the seed, which makes it reproducible: same weights, sources, order, options and seed, same
samples. Unlike :func:`rlt2t.common.sampling.sample_candidates`, a row's samples depend on the whole
call (which sources share it), not on a per-row seed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import ctranslate2
import ctranslate2.converters.transformers as ct2_transformers
import numpy as np
import torch
from ctranslate2.converters import TransformersConverter
from ctranslate2.specs import model_spec
from transformers import PreTrainedTokenizerBase

from rlt2t.common.checkpoint import MARKER, STATE_FILE, weights_checksum
from rlt2t.common.collate import encode_texts
from rlt2t.common.config import ModelConfig
from rlt2t.common.config.base import QUANTIZATIONS, ComputeType
from rlt2t.common.convert import check_out_dir
from rlt2t.common.families import (
    NO_POSITION_LIMIT,
    Family,
    UnsupportedModelError,
    family_of,
    family_of_dir,
    max_positions,
    vocab_size,
)
from rlt2t.common.family_table import EXPORT_INFO
from rlt2t.common.io import atomic_directory, atomic_write_json
from rlt2t.common.policy import Policy, adapter_base, has_tokenizer, is_adapter_checkpoint, load_policy
from rlt2t.common.sampling import SampledSequence, check_sampling, warp_logits
from rlt2t.common.tokenization import decode_ids, ids_to_tokens, load_tokenizer, save_tokenizer, tokens_to_ids

log = logging.getLogger("rlt2t.ct2")

COMPUTE_TYPES: tuple[str, ...] = get_args(ComputeType)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Files of an rlt2t checkpoint the converter must not see (training state is large and irrelevant).
_SKIP_FILES = {STATE_FILE, MARKER}


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


UNUSED_ROW = "<rlt2t_unused_"
"""Name prefix of the exported rows the tokenizer has no token for (row ``len(tokenizer) + i`` is
``<rlt2t_unused_i>``)."""


def _exact_vocabulary(model, tokenizer) -> list[str]:
    """One token name per output-embedding row, in id order: the tokenizer's tokens, then unique placeholders
    for rows it has no name for (T5 checkpoints pad their vocabulary to a multiple of 128). The stock loaders
    instead cut BART's list, pad T5's with duplicate names and drop Marian's last row."""
    rows = vocab_size(model.config)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise ValueError("the tokenizer's ids are not contiguous from 0; CTranslate2 names rows by position")
    tokens = [t for t, _ in by_id]
    if len(tokens) > rows:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens but the model only {rows} embedding rows "
                         "(resize the model with `rlt2t convert-model --vocab-size`)")
    return tokens + [f"{UNUSED_ROW}{i}>" for i in range(rows - len(tokens))]


class _ExactStart:
    """Mixin for CTranslate2's loaders: decode from the model's own decoder start token and name every row."""

    def get_vocabulary(self, model, tokenizer):
        return _exact_vocabulary(model, tokenizer)

    def set_config(self, config, model, tokenizer):
        super().set_config(config, model, tokenizer)
        # mBART's loader leaves it unset (it expects a language-code target prefix), Marian's uses </s> with a zero
        # embedding: both differ from what the Hugging Face model starts from after rlt2t's load.
        config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)


class _MarianLoader(_ExactStart, ct2_transformers.MarianMTLoader):
    """Marian exactly as Hugging Face runs it: the decoder starts from the ``<pad>`` row itself (the stock loader
    starts from a zero vector and removes that row, which equals HF only while the row is still zero, i.e.
    never after fine-tuning with tied embeddings), and no vocabulary row is dropped."""

    def get_model_spec(self, model):
        model.config.normalize_before = False
        model.config.normalize_embedding = False
        return ct2_transformers.BartLoader.get_model_spec(self, model)

    def set_decoder(self, spec, decoder):
        ct2_transformers.BartLoader.set_decoder(self, spec, decoder)


class _T5Output:
    """Mixin: CT2's T5 loader scales the decoder output when ``tie_word_embeddings`` is set, which transformers 5
    sets for every T5; whether HF scales is ``config.scale_decoder_outputs`` (v1.0 yes, v1.1 / Flan-T5 no)."""

    def get_model_spec(self, model):
        spec = super().get_model_spec(model)
        scale = getattr(model.config, "scale_decoder_outputs", model.config.tie_word_embeddings)
        spec.decoder.scale_outputs = model.config.d_model**-0.5 if scale else model_spec.OPTIONAL
        return spec


def _loader(model):
    """The CTranslate2 loader for ``model``'s family, adjusted so that the conversion decodes exactly as HF."""
    family = family_of(model.config)
    if not family.ct2:
        raise UnsupportedModelError(
            f"CTranslate2 cannot convert {family.name} models ({type(model).__name__}); use the torch backend: "
            "serve.backend=torch, rollout.backend=torch, predict.backend=torch"
        )
    if family.name == "marian":
        return _MarianLoader()
    base = type(ct2_transformers._MODEL_LOADERS[type(model.config).__name__])
    if family.name == "t5":
        return type(f"_Exact{base.__name__}", (_T5Output, _ExactStart, base), {})()
    # CT2's BART spec reads normalize_before (HF's BART is post-norm, mBART and Pegasus are pre-norm) and
    # normalize_embedding (Pegasus has no layer norm after its embeddings); transformers' configs carry neither.
    model.config.normalize_before = family.name != "bart"
    model.config.normalize_embedding = family.name != "pegasus"
    return type(f"_Exact{base.__name__}", (_ExactStart, base), {})()


class _InMemoryConverter(TransformersConverter):
    """The stock converter, fed a model and tokenizer already in memory and the loader of :func:`_loader`."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase):
        super().__init__("in-memory")
        self._model = model
        self._tokenizer = tokenizer

    def _load(self):
        with torch.no_grad():
            return _loader(self._model)(self._model, self._tokenizer)


def _convert(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out: Path, quantization: str) -> None:
    # A copy: the loader sets config fields, and CT2's int8 quantisation scales the float32 arrays it is given in
    # place, which for float32 parameters share memory with the live model.
    # A CPU copy: CTranslate2 reads the tensors' host memory (a rollout worker's model may live on a GPU).
    _InMemoryConverter(cpu_copy(model), tokenizer).convert(str(out), quantization=quantization, force=True)


def cpu_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose tensors are copied straight into host memory (deepcopy then ``.cpu()``
    would first clone every tensor where it lives: twice the model on a GPU); tied weights stay tied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            host = t.detach().to("cpu", copy=True)
            memo[id(t)] = torch.nn.Parameter(host, t.requires_grad) if isinstance(t, torch.nn.Parameter) else host
    return copy.deepcopy(model, memo)


def _export_info(source: str, source_sha256: str | None, quantization: str, model, tokenizer) -> dict:
    generation = getattr(model, "generation_config", None)
    return {
        "source": source, "source_sha256": source_sha256, "quantization": quantization,
        "family": family_of(model.config).name,
        "vocab_size": vocab_size(model.config),
        "max_position_embeddings": max_positions(model.config),
        "special_ids": _special_ids(model.config.to_dict(), tokenizer,
                                    generation.to_dict() if generation is not None else {}),
        "ctranslate2": ctranslate2.__version__, "created": time.time(),
    }


def _check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: unknown {quantization!r} (known: {', '.join(QUANTIZATIONS)})")


def _special_ids(config: Mapping, tokenizer: PreTrainedTokenizerBase, generation: Mapping) -> dict[str, int | None]:
    return {
        "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
        "unk": tokenizer.unk_token_id, "decoder_start": config.get("decoder_start_token_id"),
        "forced_eos": generation.get("forced_eos_token_id", config.get("forced_eos_token_id")),
    }


def export_ct2(
    model_dir: str | Path,
    out_dir: str | Path,
    quantization: str = "int8",
    *,
    force: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Convert a model directory (or rlt2t checkpoint) of any CTranslate2-convertible family into an export.

    The model is loaded with ``load_policy`` (the tokenizer from ``model_dir`` when it holds one, else from
    ``tokenizer_dir``) and converted in memory by :func:`export_policy`; the source directory is never modified.
    A LoRA adapter checkpoint (peft's ``adapter_config.json`` naming its base, no ``config.json``) is loaded
    merged into its base and that plain model is converted (the tokenizer from the base, else the checkpoint's
    own, else ``tokenizer_dir``).

    ``out_dir`` is replaced as a whole, so before anything is converted it is refused when it is, contains or
    lies inside what is read: ``model_dir``, the checkpoint root around an rlt2t checkpoint (its other
    checkpoints), an adapter's base directory and ``tokenizer_dir`` (:func:`rlt2t.common.convert.check_out_dir`,
    resolved paths, ``force`` does not lift it).

    Raises FileNotFoundError (not a model directory, an adapter's base gone), ValueError (``out_dir`` where the
    inputs are, unknown quantization, vocabulary mismatch), FileExistsError (``out_dir`` exists and not
    ``force``), UnsupportedModelError (a family CTranslate2 cannot convert: the warm-started EncoderDecoderModel).
    """
    _check_quantization(quantization)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    adapter = is_adapter_checkpoint(model_dir)
    if not adapter and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"--checkpoint {model_dir}: not a model directory (no config.json)")
    weights_dir = adapter_base(model_dir) if adapter else model_dir  # FileNotFoundError: the base is gone
    inputs = [model_dir, weights_dir]
    if (model_dir / MARKER).is_file():
        inputs.append(model_dir.parent)  # an rlt2t checkpoint: its root holds the stage's other checkpoints
    if tokenizer_dir is not None:
        inputs.append(Path(tokenizer_dir))
    check_out_dir(out_dir, inputs, force=force)
    family = source_family(model_dir)
    if not family.ct2:
        raise UnsupportedModelError(
            f"{model_dir}: CTranslate2 cannot convert {family.name} models; use the torch backend: "
            "serve.backend=torch, rollout.backend=torch, predict.backend=torch"
        )
    if adapter and not has_tokenizer(weights_dir) and has_tokenizer(model_dir):
        tokenizer_dir = model_dir  # the tokenizer the adapters were trained with, saved beside them
    if not has_tokenizer(weights_dir) and tokenizer_dir is None:
        raise ValueError(f"{weights_dir} holds no tokenizer; pass tokenizer_dir (the run's tokenizer directory)")
    t0 = time.perf_counter()
    policy = load_policy(ModelConfig(preset=None, dropout=0.0), tokenizer_dir, checkpoint=model_dir)  # merged
    export_policy(policy, out_dir, quantization, source=str(model_dir.resolve()),
                  source_sha256=source_checksum(model_dir))
    log.info("exported %s → %s (%s) in %.2f s", model_dir, out_dir, quantization, time.perf_counter() - t0)
    return out_dir


def source_family(model_dir: str | Path) -> Family:
    """The family of a model directory, or of an adapter checkpoint's base (what :func:`export_ct2` converts).
    FileNotFoundError when it is neither (or the base is gone)."""
    model_dir = Path(model_dir)
    return family_of_dir(adapter_base(model_dir) if is_adapter_checkpoint(model_dir) else model_dir)


def source_checksum(model_dir: str | Path) -> str:
    """The identity of the weights :func:`export_ct2` converts: :func:`weights_checksum` of a model directory; of
    an adapter checkpoint, the sha256 of its adapters' checksum and its base's (either changing changes it)."""
    model_dir = Path(model_dir)
    if not is_adapter_checkpoint(model_dir):
        return weights_checksum(model_dir)
    both = f"{weights_checksum(model_dir)}:{weights_checksum(adapter_base(model_dir))}"
    return hashlib.sha256(both.encode()).hexdigest()


def export_policy(policy: Policy, out_dir: str | Path, quantization: str = "int8", *,
                  source: str = "memory", source_sha256: str | None = None) -> Path:
    """Convert an in-memory policy (no save/reload of the weights) into an export directory at ``out_dir``.

    Used by ``rlt2t export`` and by the rollout backend after each published version; ``source`` is recorded in
    the export info. Written to a temporary sibling and renamed into place.
    """
    _check_quantization(quantization)
    model, tokenizer = policy.model, policy.tokenizer
    with atomic_directory(Path(out_dir)) as tmp:
        # tmp is our own fresh directory: the converter may replace it (force=True).
        _convert(model, tokenizer, tmp, quantization)
        save_tokenizer(tokenizer, tmp)
        atomic_write_json(tmp / EXPORT_INFO, _export_info(source, source_sha256, quantization, model, tokenizer))
    return Path(out_dir)


def read_export_info(export_dir: str | Path) -> dict:
    """The ``rlt2t_export.json`` of an export directory (FileNotFoundError naming the directory if absent)."""
    path = Path(export_dir) / EXPORT_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{export_dir}: not an rlt2t CTranslate2 export (no {EXPORT_INFO}; run `rlt2t export`)")
    return json.loads(path.read_text())


def is_export_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / EXPORT_INFO).is_file() and ctranslate2.contains_model(str(path))


# --------------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hypothesis:
    """One decoded sequence of a source."""

    text: str
    """Decoded text, special tokens dropped, whitespace normalised."""
    token_ids: tuple[int, ...]
    """Generated ids without the decoder start token; EOS last when the sequence ended (or was forced to)."""
    score: float
    """CTranslate2's score: the sum of the token log-probs, divided by length**length_penalty in beam
    search (0 penalty: the plain sum). Sampling scores are under the tempered, top-k distribution."""


@dataclass(frozen=True)
class _Decoded:
    """One hypothesis of :meth:`Ct2Policy._decode`."""

    ids: list[int]
    """Row ids without the decoder start token; EOS last when decoded, or appended when ``forced``."""
    forced: bool
    score: float
    logits: Sequence[Any]
    """Each decoded step's vocabulary logits when asked for (the forced EOS has none), else empty."""


class Ct2Policy:
    """A CTranslate2 translator plus our tokenizer, loaded from an export directory.

    ``compute_type`` "default" keeps the export's quantization; ``intra_threads`` 0 is CT2's default.
    ``max_batch_size`` / ``batch_type`` are passed to every translate and score call (0: one batch).
    """

    def __init__(
        self,
        export_dir: str | Path,
        *,
        device: str = "cpu",
        compute_type: str = "default",
        inter_threads: int = 1,
        intra_threads: int = 0,
        max_batch_size: int = 0,
        batch_type: str = "examples",
        max_source_len: int | None = None,
    ):
        self.export_dir = Path(export_dir)
        self.info = read_export_info(self.export_dir)
        if compute_type not in COMPUTE_TYPES:
            raise ValueError(f"compute_type: unknown {compute_type!r} (known: {', '.join(COMPUTE_TYPES)})")
        if batch_type not in ("examples", "tokens"):
            raise ValueError(f"batch_type must be 'examples' or 'tokens', got {batch_type!r}")
        self.tokenizer = load_tokenizer(self.export_dir)
        self._named_rows = len(self.tokenizer.get_vocab())  # rows past these are <rlt2t_unused_i> (token_ids)
        self.vocab_rows: int = self.info["vocab_size"]  # the model's output rows, named or not
        self._translator_args = dict(device=device, compute_type=compute_type, inter_threads=inter_threads,
                                     intra_threads=intra_threads)
        self.max_batch_size = max_batch_size
        self.batch_type = batch_type
        positions = self.info.get("max_position_embeddings") or NO_POSITION_LIMIT  # T5: no limit
        self.max_source_len = max_source_len or positions
        self.max_target_len: int = positions
        special = self.info["special_ids"]
        self.eos_id: int = special["eos"]
        self.forced_eos_id: int | None = special.get("forced_eos")
        self.translator = ctranslate2.Translator(str(self.export_dir), **self._translator_args)

    def __repr__(self) -> str:
        return f"Ct2Policy({str(self.export_dir)!r}, {self._translator_args})"

    def reseed(self, seed: int) -> None:
        """Restart the sampling random stream from ``seed`` (rebuilds the translator; see the module doc)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        ctranslate2.set_random_seed(seed % (1 << 32))  # CT2 takes an unsigned 32-bit seed
        self.translator = ctranslate2.Translator(str(self.export_dir), **self._translator_args)

    def token_ids(self, tokens: Sequence[str]) -> list[int]:
        """The row ids of tokens CTranslate2 returned: the tokenizer's ids, and for the rows it has no token
        for (``<rlt2t_unused_i>``, e.g. T5's padding to a multiple of 128) their own row, not ``<unk>``."""
        named = self._named_rows
        return [named + int(t[len(UNUSED_ROW):-1]) if t.startswith(UNUSED_ROW) else i
                for t, i in zip(tokens, tokens_to_ids(self.tokenizer, tokens), strict=True)]

    def row_tokens(self, ids: Sequence[int]) -> list[str]:
        """The CTranslate2 token names of row ids, the inverse of :meth:`token_ids`: the tokenizer's tokens, and
        ``<rlt2t_unused_i>`` for the rows it has no token for (the tokenizer would give None)."""
        named = self._named_rows
        tokens = iter(ids_to_tokens(self.tokenizer, [i for i in ids if i < named]))
        return [next(tokens) if i < named else f"{UNUSED_ROW}{i - named}>" for i in ids]

    def source_tokens(self, sources: Sequence[str]) -> list[list[str]]:
        """Token strings of each source, EOS included, truncated like training (``encode_texts``)."""
        ids, _ = encode_texts(self.tokenizer, sources, self.max_source_len)
        return [self.row_tokens(x) for x in ids]

    def target_ids(self, targets: Sequence[str]) -> list[list[int]]:
        """Ids of each target as training labels hold them: the tokenizer's full target template
        (``encode_texts(..., target=True)``, special tokens included: ``text </s>``, BART's ``<s> text </s>``,
        mBART's ``text </s> tgt_lang``), cut like training only beyond the model's positions."""
        return encode_texts(self.tokenizer, list(targets), self.max_target_len, target=True)[0] if targets else []

    def target_tokens(self, targets: Sequence[str]) -> list[list[str]]:
        """Token strings ``score_batch`` gets for each target: its :meth:`target_ids` without a final EOS
        (``score_batch`` appends the EOS itself)."""
        return [self.row_tokens(self._without_eos(x)) for x in self.target_ids(targets)]

    def _without_eos(self, ids: Sequence[int]) -> list[int]:
        return list(ids[:-1]) if ids and ids[-1] == self.eos_id else list(ids)

    def generate(
        self,
        sources: Sequence[str],
        *,
        beam_size: int = 1,
        num_hypotheses: int = 1,
        max_new_tokens: int = 64,
        sampling_topk: int = 1,
        sampling_temperature: float = 1.0,
        length_penalty: float = 1.0,
        min_new_tokens: int = 0,
        seed: int | None = None,
        sampling_topp: float = 1.0,
        sampling_epsilon: float = 0.0,
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
    ) -> list[list[Hypothesis]]:
        """Beam search, greedy (``beam_size=1``, ``sampling_topk=1``) or sampling (``beam_size=1``,
        ``sampling_topk`` k > 1 or 0 for the whole vocabulary; ``sampling_topp`` < 1 adds a nucleus filter) of each
        source.

        Returns one list of ``num_hypotheses`` hypotheses per source (best first for beam search).
        ``max_new_tokens`` counts the EOS, as in HF ``generate``; EOS is not allowed before ``min_new_tokens``
        tokens. ``seed`` reseeds sampling first. ``sampling_epsilon`` is here for the torch runner's signature:
        CTranslate2 has no epsilon sampling, so anything but 0 is refused. ``no_repeat_ngram_size`` (0: off) and
        ``repetition_penalty`` (1: off) are CTranslate2's own, for beam search and greedy decoding (refused with
        sampling, as the torch runner refuses them: samples come from the model's distribution).
        """
        if beam_size < 1 or num_hypotheses < 1:
            raise ValueError(f"beam_size and num_hypotheses must be >= 1, got {beam_size}, {num_hypotheses}")
        if beam_size > 1 and num_hypotheses > beam_size:
            raise ValueError(f"num_hypotheses={num_hypotheses} exceeds beam_size={beam_size}")
        if beam_size > 1 and sampling_topk != 1:
            raise ValueError("sampling needs beam_size=1 (got beam_size > 1 with sampling_topk != 1)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if sampling_topk < 0 or not sampling_temperature > 0:
            raise ValueError(f"sampling_topk must be >= 0 and sampling_temperature > 0, got {sampling_topk}, "
                             f"{sampling_temperature}")
        if not 0.0 < sampling_topp <= 1.0:
            raise ValueError(f"sampling_topp must be in (0, 1], got {sampling_topp}")
        if sampling_epsilon != 0.0:
            raise ValueError(f"sampling_epsilon={sampling_epsilon}: CTranslate2 has no epsilon sampling (the torch "
                             "backend has)")
        if no_repeat_ngram_size < 0 or not repetition_penalty > 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0 and repetition_penalty > 0, got "
                             f"{no_repeat_ngram_size}, {repetition_penalty}")
        if sampling_topk != 1 and (no_repeat_ngram_size, repetition_penalty) != (0, 1.0):
            raise ValueError("no_repeat_ngram_size and repetition_penalty apply to beam search and greedy decoding "
                             "only (samples are drawn from the model's distribution)")
        if not sources:
            return []
        # CT2 refuses several hypotheses from greedy search (top-1 "sampling"); they would all be equal.
        copies = num_hypotheses if beam_size == 1 and sampling_topk == 1 else 1
        _, decoded = self._decode(
            sources, num_hypotheses=num_hypotheses // copies, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens, sampling_topk=sampling_topk, seed=seed,
            beam_size=beam_size, length_penalty=length_penalty, sampling_temperature=sampling_temperature,
            sampling_topp=sampling_topp, no_repeat_ngram_size=no_repeat_ngram_size,
            repetition_penalty=repetition_penalty)
        return [[Hypothesis(text=" ".join(decode_ids(self.tokenizer, d.ids, skip_special_tokens=True).split()),
                            token_ids=tuple(d.ids), score=d.score) for d in hyps] * copies for hyps in decoded]

    def _decode(self, sources: Sequence[str], *, num_hypotheses: int, max_new_tokens: int, sampling_topk: int,
                seed: int | None, min_new_tokens: int = 0, with_logits: bool = False, **options: Any
                ) -> tuple[int, list[list[_Decoded]]]:
        """``translate_batch`` as :meth:`generate` and :func:`sample_ct2_logprobs` run it (``options`` are passed
        on): a top-k at least the model's rows becomes 0 (no filter: CT2 rejects k > vocabulary), ``seed``
        reseeds first, and with a forced EOS the last position is ours to fill (see the module doc: one step
        less, the EOS appended; a 1-token limit is that EOS alone). Returns the top-k CT2 sampled with and
        ``num_hypotheses`` hypotheses per source (RuntimeError when CT2 returns another count); ``with_logits`` asks
        for each step's vocabulary logits."""
        if sampling_topk >= self.vocab_rows:
            sampling_topk = 0
        if seed is not None:
            self.reseed(seed)
        forced_eos = self.forced_eos_id
        if forced_eos is not None and max_new_tokens == 1:
            return sampling_topk, [[_Decoded([forced_eos], True, 0.0, ())] * num_hypotheses for _ in sources]
        steps = max_new_tokens - 1 if forced_eos is not None else max_new_tokens
        results = self.translator.translate_batch(
            self.source_tokens(sources), max_batch_size=self.max_batch_size, batch_type=self.batch_type,
            num_hypotheses=num_hypotheses, max_decoding_length=steps, min_decoding_length=min(min_new_tokens, steps),
            max_input_length=0, return_scores=True, return_end_token=True, return_logits_vocab=with_logits,
            sampling_topk=sampling_topk, **options)
        out = []
        for i, result in enumerate(results):
            if len(result.hypotheses) != num_hypotheses:  # anything else breaks the callers' row layout
                raise RuntimeError(f"CTranslate2 returned {len(result.hypotheses)} samples for source {i}, "
                                   f"expected {num_hypotheses}")
            step_logits = result.logits if with_logits else [()] * num_hypotheses
            hyps = []
            for tokens, score, hyp_logits in zip(result.hypotheses, result.scores, step_logits, strict=True):
                ids = self.token_ids(tokens)
                forced = False
                if forced_eos is not None and (not ids or ids[-1] != self.eos_id):
                    ids.append(forced_eos)
                    forced = True
                hyps.append(_Decoded(ids, forced, float(score), hyp_logits))
            out.append(hyps)
        return sampling_topk, out

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[list[float]]:
        """Per-token log-probs of each target given its source (teacher forcing): one per id of
        :meth:`target_ids` (the training labels, every special token of the target template included).

        Equal to HF's log-softmax at those labels. ``score_batch`` appends an EOS to what it gets: for a template
        that ends with the EOS that is the template's own, for one that does not (mBART's ``</s> tgt_lang``) the
        extra last log-prob is dropped (it cannot change the earlier ones).
        """
        if len(sources) != len(targets):
            raise ValueError(f"sources and targets must have the same length, got {len(sources)} and {len(targets)}")
        return self.score_ids(sources, self.target_ids(targets))

    def score_ids(self, sources: Sequence[str], labels: Sequence[Sequence[int]]) -> list[list[float]]:
        """Raw log-probs of label id rows (a template's, or generated rows, EOS last when they end with one) given
        their sources: one per id."""
        if not sources:
            return []
        results = self.translator.score_batch(
            self.source_tokens(sources), [self.row_tokens(self._without_eos(x)) for x in labels],
            max_batch_size=self.max_batch_size, batch_type=self.batch_type, max_input_length=0,
        )
        return [list(map(float, r.log_probs))[: len(x)] for r, x in zip(results, labels, strict=True)]


# --------------------------------------------------------------------------------------------------
# The `ct2` rollout backend
# --------------------------------------------------------------------------------------------------


def ct2_sampler_from_state_dict(
    policy: Policy,
    state_dict: Mapping[str, torch.Tensor] | None,
    work_dir: str | Path,
    compute_type: str = "int8",
    *,
    intra_threads: int = 0,
    max_batch_size: int = 0,
    max_source_len: int | None = None,
    name: str = "current",
    device: str = "cpu",
) -> Ct2Policy:
    """Load ``state_dict`` (strictly; None keeps the current weights) into ``policy`` and convert it.

    The conversion goes straight from the in-memory model (no ``save_pretrained``) into
    ``work_dir/<name>``, replacing a previous one; weights are stored as ``compute_type`` when that is a
    quantization, so loading does no further conversion. Returns a translator over it. For the `small`
    preset (6M parameters) this took 0.07-0.8 s on a busy 2-core machine (a save + export from disk: 0.2 s).
    """
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"compute_type: unknown {compute_type!r} (known: {', '.join(COMPUTE_TYPES)})")
    if state_dict is not None:
        policy.model.load_state_dict(state_dict, strict=True)
    quantization = compute_type if compute_type in QUANTIZATIONS else "float32"
    out = export_policy(policy, Path(work_dir) / name, quantization, source=policy.origin)
    return Ct2Policy(out, device=device, compute_type=compute_type, intra_threads=intra_threads,
                     max_batch_size=max_batch_size, max_source_len=max_source_len)


def sample_ct2(
    ct2: Ct2Policy,
    sources: Sequence[str],
    k: int,
    top_k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int | None,
    top_p: float = 1.0,
) -> list[list[int]]:
    """``k`` samples per source (top-k, top-p, temperature), in the row layout of ``sample_candidates``.

    Row ``i * k + j`` is source i, sample j: token ids without the decoder start token, EOS last when the
    row ended (a row that reaches ``max_new_tokens`` gets the forced EOS, as in ``sample_candidates``).
    ``top_k=0`` samples from the whole vocabulary, ``top_k=1`` is greedy. With ``seed`` the call is
    reproducible (same weights, sources, k, options and seed: same rows); see the module doc.
    """
    check_sampling(k, top_k, temperature, top_p)
    per_source = ct2.generate(sources, beam_size=1, num_hypotheses=k, max_new_tokens=max_new_tokens,
                              sampling_topk=top_k, sampling_temperature=temperature, seed=seed, sampling_topp=top_p)
    return [list(h.token_ids) for hyps in per_source for h in hyps]  # k per source (Ct2Policy._decode checks)



def sample_ct2_logprobs(
    ct2: Ct2Policy,
    sources: Sequence[str],
    k: int,
    top_k: int,
    temperature: float,
    max_new_tokens: int,
    seed: int | None,
    top_p: float = 1.0,
) -> list[SampledSequence]:
    """:func:`sample_ct2` with per-token log-probs: the raw model's and the one under the distribution
    CTranslate2 sampled from (temperature, top-k, top-p), for a policy-gradient ratio against the learner.

    CTranslate2 returns each step's vocabulary logits (``return_logits_vocab``) at temperature 1 with its
    own masks applied (none here: ``min_decoding_length`` 0); the transform of
    ``rlt2t.common.sampling.warp_logits`` on them gives what the sampler drew from (CTranslate2's nucleus is
    transformers' top-p after the temperature and top-k: tests/unit/common/test_ct2_rows.py). A quantised
    model's distribution differs from the float32 learner's: that is what the learner's truncated
    importance weights correct. The forced EOS at the limit gets sample log-prob 0 (it was not drawn).
    """
    check_sampling(k, top_k, temperature, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not sources:
        return []
    top_k, decoded = ct2._decode(sources, num_hypotheses=k, max_new_tokens=max_new_tokens, sampling_topk=top_k,
                                 seed=seed, with_logits=True, beam_size=1, sampling_temperature=temperature,
                                 sampling_topp=top_p)
    rows: list[SampledSequence] = []
    for d in (d for hyps in decoded for d in hyps):
        drawn = d.ids[:-1] if d.forced else d.ids
        raw_lp: list[float] = []
        sample_lp: list[float] = []
        if drawn:
            logits = torch.from_numpy(np.stack([np.asarray(x, dtype=np.float32) for x in d.logits[: len(drawn)]]))
            index = torch.tensor(drawn)[:, None]
            raw_lp = logits.log_softmax(-1).gather(-1, index)[:, 0].tolist()
            warped = warp_logits(logits, temperature, top_k, top_p)
            sample_lp = warped.log_softmax(-1).gather(-1, index)[:, 0].tolist()
        if d.forced:  # not computed by the sampler; the learner leaves forced tokens out
            raw_lp.append(0.0)
            sample_lp.append(0.0)
        rows.append(SampledSequence(list(d.ids), raw_lp, sample_lp, forced=d.forced))
    return rows
