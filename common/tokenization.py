"""Tokenizers: integer-id vocabularies, trained subword BPE, or any saved Hugging Face tokenizer.

All three end up as a Hugging Face tokenizer that saves and reloads with ``save_pretrained`` /
``AutoTokenizer.from_pretrained``, so the rest of rlt2t never asks which kind it holds.

The integer-id vocabulary mirrors BART's special-token order so that a shrunk pretrained BART
(`rlt2t convert-model`) keeps meaningful rows for them:

    <s>=0  <pad>=1  </s>=2  <unk>=3  <mask>=4  <sep>=5  <extra_id_0..S-1>=6..5+S  data token k = 6+S+k

With the default 100 sentinels the offset is 106, as in the original competition system.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import cast

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>", "<sep>"]
SEP = "<sep>"
INFO_FILE = "rlt2t_tokenizer.json"  # our own facts about a tokenizer, saved beside it
# A string holding one of these is not Unicode text (JSON "\ud800" escapes produce them).
LONE_SURROGATE = re.compile("[\\ud800-\\udfff]")


def sentinel_token(i: int) -> str:
    return f"<extra_id_{i}>"


def _wrap(tok: Tokenizer, num_sentinels: int) -> PreTrainedTokenizerFast:
    # Sources and targets both end with </s>; the decoder starts from </s> (BART's convention).
    eos = tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        sep_token=SEP,
        additional_special_tokens=[sentinel_token(i) for i in range(num_sentinels)],
        model_max_length=1_000_000,
    )


def build_ids_tokenizer(num_data_tokens: int, num_sentinels: int = 100) -> PreTrainedTokenizerFast:
    """A word-level vocabulary over the strings "0".."N-1" (space-separated integer texts)."""
    if num_data_tokens < 1:
        raise ValueError(f"num_data_tokens must be >= 1, got {num_data_tokens}")
    specials = SPECIALS + [sentinel_token(i) for i in range(num_sentinels)]
    vocab = {t: i for i, t in enumerate(specials)}
    offset = len(vocab)
    vocab.update({str(k): offset + k for k in range(num_data_tokens)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="\x00", cleanup=False)  # joins tokens with single spaces
    fast = _wrap(tok, num_sentinels)
    fast.init_kwargs["rlt2t"] = {"kind": "ids", "offset": offset, "num_data_tokens": num_data_tokens}
    return fast


def train_subword_tokenizer(
    texts: Iterable[str], vocab_size: int = 8000, num_sentinels: int = 100, show_progress: bool = False
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on natural text (a user's real-language JSONL)."""
    specials = SPECIALS + [sentinel_token(i) for i in range(num_sentinels)]
    if vocab_size <= len(specials) + 256:
        raise ValueError(f"vocab_size={vocab_size} leaves no room beyond {len(specials)} specials and 256 bytes "
                         f"(tokenizer.vocab_size: at least {len(specials) + 257})")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = _wrap(tok, num_sentinels)
    fast.init_kwargs["rlt2t"] = {"kind": "subword"}
    return fast


def save_tokenizer(tok: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """``save_pretrained`` plus our info file (kind, id offset) so a reload knows what it holds."""
    out_dir = Path(out_dir)
    tok.save_pretrained(out_dir)
    info = tok.init_kwargs.get("rlt2t") or {"kind": "pretrained"}
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load any saved tokenizer directory (ours or a downloaded Hugging Face one)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a loadable tokenizer directory ({e})") from e
    info_path = path / INFO_FILE
    tok.init_kwargs["rlt2t"] = json.loads(info_path.read_text()) if info_path.is_file() else {"kind": "pretrained"}
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        # A tokenizer.json may carry its own fixed padding and truncation (all-MiniLM-L6-v2's pads and cuts every
        # text at 128 tokens). Lengths here come from data.max_*_len and batches pad themselves; the Rust encoder,
        # which the text checks and token counts call directly, would otherwise pad every text with [PAD].
        backend.no_padding()
        backend.no_truncation()
    return tok


def template_affixes(tok: PreTrainedTokenizerBase, *, target: bool = False) -> tuple[int, int]:
    """How many special tokens ``tok(text)`` puts before and after every text: (0, 1) for ``text </s>`` (ours,
    BART, T5, Marian, Pegasus), (0, 2) for mBART-25's ``text </s> en_XX``, (1, 1) for BERT's ``[CLS] text [SEP]``.
    ``target``: of the target template, ``tok(text_target=text)`` (mBART's ``text </s> tgt_lang``)."""
    def encode(text: str) -> list[int]:
        encoded = tok(text_target=text, add_special_tokens=True) if target else tok(text, add_special_tokens=True)
        return cast(list[int], encoded["input_ids"])

    empty, one = encode(""), encode("a")
    prefix = 0
    while prefix < len(empty) and prefix < len(one) and empty[prefix] == one[prefix]:
        prefix += 1
    return prefix, len(empty) - prefix


def ids_to_tokens(tok: PreTrainedTokenizerBase, ids: Sequence[int]) -> list[str]:
    """The token strings of ``ids`` (``convert_ids_to_tokens`` of a list, whose annotation also covers one id)."""
    return cast(list[str], tok.convert_ids_to_tokens(list(ids)))


def tokens_to_ids(tok: PreTrainedTokenizerBase, tokens: Sequence[str]) -> list[int]:
    """The ids of ``tokens`` (``convert_tokens_to_ids`` of a list, whose annotation also covers one token)."""
    return cast(list[int], tok.convert_tokens_to_ids(list(tokens)))


def decode_ids(tok: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
    """The text of one id list (``decode``, whose annotation also covers a batch's list of texts)."""
    return cast(str, tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def tokenizer_kind(tok: PreTrainedTokenizerBase) -> str:
    return (tok.init_kwargs.get("rlt2t") or {}).get("kind", "pretrained")


def sentinel_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """Span-corruption sentinels, in span order: the tokenizer's own ``<extra_id_0>``, ``<extra_id_1>``, ...
    where it has them (T5, Flan-T5 and mT5 tokenizers, whose ``<extra_id_0>`` is the highest id and the rest count
    down; the project's ``ids`` and ``subword`` tokenizers, which put them after the specials), else the mask
    token for every span (pretrained BART, mBART; Pegasus's ``<mask_2>``)."""
    ids: list[int] = []
    unk = tok.unk_token_id
    while True:
        i = tok.convert_tokens_to_ids(sentinel_token(len(ids)))  # one token: one id (or None)
        if not isinstance(i, int) or i == unk:
            break
        ids.append(i)
    if ids:
        return ids
    if tok.mask_token_id is None:
        raise ValueError(f"{type(tok).__name__} has neither <extra_id_*> sentinels nor a mask token for span "
                         "corruption (Marian's have none): skip denoising pretraining (pretrain.enabled=false)")
    return [tok.mask_token_id]


def text_checker(tok: PreTrainedTokenizerBase) -> Callable[[str], str | None]:
    """The token rule every text obeys (data files, every server route): a function giving the first
    problem of a text as a message, or None when the text is fine.

    - No lone surrogate (U+D800..U+DFFF): such a string is not Unicode text.
    - No special token but the field separator ``<sep>``: ``</s>``, ``<pad>``, ``<s>``, ``<unk>``,
      ``<mask>`` and the sentinels are control tokens; a tokenizer would read them as such (a target
      ``"</s>"`` would become ids [2, 2]), so they are refused, in every tokenizer kind.
    - ``ids`` vocabularies only: every token is a data token, written exactly as "0".."N-1". Subword and
      pretrained tokenizers read any other text (byte-level BPE has no unknown token; others map what
      they do not know to ``<unk>``).

    The tokenizer itself finds the tokens (its own splitting and special-token matching), so the rule
    cannot drift from what the model is fed.
    """
    kind = tokenizer_kind(tok)
    n = int((tok.init_kwargs.get("rlt2t") or {}).get("num_data_tokens", 0))
    unk = tok.unk_token_id
    # The separator is allowed only as our own `<sep>` (pretrained BART calls `</s>` its sep_token).
    sep_id = tok.convert_tokens_to_ids(SEP) if SEP in tok.get_vocab() else None
    control = set(tok.all_special_ids) - {sep_id}
    backend = getattr(tok, "backend_tokenizer", None)
    only = f" (only {SEP!r} is)" if sep_id is not None else ""  # a pretrained vocabulary has no `<sep>` to offer

    def check(text: str) -> str | None:
        if (bad := LONE_SURROGATE.search(text)) is not None:
            return f"lone surrogate U+{ord(bad.group()):04X} at character {bad.start()}: not Unicode text"
        if backend is None:  # a slow pretrained tokenizer: special tokens by their text
            found = [t for t in tok.all_special_tokens if t != SEP and t in text]
            return f"special token {found[0]!r} is not allowed in a text{only}" if found else None
        encoding = backend.encode(text, add_special_tokens=False)
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            piece = text[start:end]
            if token_id == unk and piece != tok.unk_token:
                if kind != "ids":
                    continue
                if not (piece.isascii() and piece.isdigit()):
                    return (f"token {piece!r} is not a non-negative integer (this run's tokenizer is the `ids` "
                            "kind, for texts of integer tokens; for words build a subword one: tokenizer.kind=subword "
                            "then `rlt2t tokenizer build`)")
                if str(int(piece)) != piece:
                    return f"token {piece!r} is not in the vocabulary (data tokens have no leading zeros)"
                return f"token {piece!r} is outside the vocabulary (0..{n - 1})"
            if token_id in control:
                return f"special token {piece!r} is not allowed in a text{only}"
        return None

    return check


def build_tokenizer(kind: str, *, num_data_tokens: int, num_sentinels: int, vocab_size: int,
                    train_texts: Iterable[str] | None = None, path: str | Path | None = None
                    ) -> PreTrainedTokenizerBase:
    """Dispatch on ``tokenizer.kind``: build an id vocabulary, train a BPE, or load a directory."""
    if kind == "ids":
        return build_ids_tokenizer(num_data_tokens, num_sentinels)
    if kind == "subword":
        if train_texts is None:
            raise ValueError("tokenizer.kind=subword needs training texts (data.train)")
        return train_subword_tokenizer(train_texts, vocab_size, num_sentinels)
    if kind == "pretrained":
        if path is None:
            raise ValueError("tokenizer.kind=pretrained needs tokenizer.path (a saved tokenizer directory)")
        return load_tokenizer(path)
    raise ValueError(f"tokenizer.kind: unknown kind {kind!r}")
