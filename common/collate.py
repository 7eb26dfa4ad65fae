"""Turning texts into padded tensors, the same way everywhere (training, evaluation, rollouts)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlt2t.common.tokenization import template_affixes

log = logging.getLogger("rlt2t.batching")

# Label padding, Hugging Face's convention (its built-in loss ignores exactly this value); the one definition.
IGNORE_INDEX = -100


@dataclass
class Encoded:
    """Token ids of a set of (source, target) pairs (EOS included), before padding."""

    sources: list[list[int]]
    targets: list[list[int]]
    truncated_sources: int = 0
    truncated_targets: int = 0


def encode_texts(tok: PreTrainedTokenizerBase, texts: Sequence[str], max_len: int, *, target: bool = False
                 ) -> tuple[list[list[int]], int]:
    """Tokenize with the tokenizer's special tokens, truncating content (never those tokens: EOS, a language code,
    [CLS]) to ``max_len``; returns ids and #truncated.

    ``target``: texts the decoder produces, encoded with the tokenizer's target template where it has one
    (:func:`uses_target_template`: mBART's ``text </s> tgt_lang`` rather than the source's ``text </s> src_lang``).
    """
    target = target and uses_target_template(tok)
    full = _tokenize(tok, list(texts), target)
    out, truncated = [], 0
    affixes = None
    for ids in full:
        if len(ids) > max_len:
            truncated += 1
            affixes = affixes or template_affixes(tok, target=target)
            ids = cut_ids(ids, max_len, affixes)
        out.append(ids)
    return out, truncated


def cut_ids(ids: Sequence[int], max_len: int, affixes: tuple[int, int]) -> list[int]:
    """``ids`` cut to ``max_len`` by dropping content from the end, keeping the template's ``affixes`` (how many
    special tokens lead and trail it, see ``template_affixes``): an EOS or language code survives any cut."""
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    prefix, suffix = affixes
    keep = max(max_len - prefix - suffix, 0)
    return ids[:prefix] + ids[prefix : prefix + keep] + ids[len(ids) - suffix :]


def uses_target_template(tok: PreTrainedTokenizerBase) -> bool:
    """Whether targets need their own template: a language-code tokenizer (mBART) with a target language (saved
    with it, or ``model.tgt_lang``, which ``prepare_model`` sets). Every other tokenizer encodes both sides alike."""
    return getattr(tok, "tgt_lang", None) is not None


def _tokenize(tok: PreTrainedTokenizerBase, texts: list[str], target: bool) -> list[list[int]]:
    if target:
        return tok(text_target=texts, add_special_tokens=True, truncation=False)["input_ids"]
    return tok(texts, add_special_tokens=True, truncation=False)["input_ids"]


def encode_examples(tok: PreTrainedTokenizerBase, sources: Sequence[str], targets: Sequence[str],
                    max_source_len: int, max_target_len: int, what: str = "data") -> Encoded:
    """Sources with the source template, targets with the target one (they differ for mBART with language
    codes: labels end with the target language, as the decoder start names it), each cut to its limit."""
    src, ts = encode_texts(tok, sources, max_source_len)
    tgt, tt = encode_texts(tok, targets, max_target_len, target=True)
    if ts or tt:
        log.warning("%s: truncated %d sources to %d tokens and %d targets to %d tokens",
                    what, ts, max_source_len, tt, max_target_len)
    return Encoded(src, tgt, ts, tt)


def pad(seqs: Sequence[Sequence[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids into a LongTensor [B, max_len]."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


def collate_seq2seq(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]] | None,
                    pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids [B, S], attention_mask [B, S] and, with targets, labels [B, T] padded with -100."""
    input_ids = pad(sources, pad_id)
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != pad_id).long()}
    # A real pad id inside a source (it should not happen) must still be attended: mask by length.
    for i, s in enumerate(sources):
        batch["attention_mask"][i, : len(s)] = 1
    if targets is not None:
        batch["labels"] = pad(targets, IGNORE_INDEX)
    return batch
