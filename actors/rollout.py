"""Rollout worker of rank RL: samples K candidates per training source with the current policy, adds the
gold target, deduplicates and draws the pair the reward worker will score (DESIGN.md, step 5).

Sampling is reproducible per example: the samples and the pair of an example depend only on the weights
and on (seed, policy version, example id), never on which other examples share the batch or which worker
ran it. Hugging Face ``generate`` draws from the global RNG, so this module has its own batched sampler,
:func:`sample_candidates`, which gives every decoder row its own ``torch.Generator`` and samples with the
Gumbel-max trick. The policy server reuses that sampler.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import tempfile
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers.modeling_outputs import BaseModelOutput

from rlt2t.actors.types import CandidateSet
from rlt2t.common.batching import collate_seq2seq, encode_texts
from rlt2t.common.config import ModelConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.policy import Policy, check_sampling, load_policy

log = logging.getLogger("rlt2t.rollout")


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed from ints and strings, the same in every process and Python version.

    Python's ``hash()`` of a string is salted per process, so it cannot key randomness that must agree
    across Ray workers; a BLAKE2 digest of the parts' JSON encoding (unambiguous) can.
    """
    for i, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, int | str):
            raise TypeError(f"stable_seed: parts[{i}] must be an int or str, got {type(part).__name__}")
    digest = hashlib.blake2b(json.dumps(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # torch generators take seeds below 2**63 everywhere


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: the form candidates are compared and deduplicated in."""
    return " ".join(text.split())


def _sample_next_tokens(logits: Tensor, top_k: int, temperature: float, generators: Sequence[torch.Generator]) -> Tensor:
    """One token per row from softmax(top-k(logits) / temperature): logits [N, V] -> token ids [N].

    Gumbel-max: argmax(scores + G) with G = -log(-log U) is an exact sample of softmax(scores). Row r's
    uniforms U come from ``generators[r]`` alone, V of them per step, so a row's draws do not depend on
    the other rows.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp16/bf16 logits: sample in fp32
    scores = logits.to(dtype) / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        # Ties with the k-th score are kept, as Hugging Face's top-k warper does.
        scores = scores.masked_fill(scores < kth, float("-inf"))
    uniforms = torch.stack([torch.rand(vocab, generator=g, device=g.device, dtype=dtype) for g in generators])
    # U = 0 gives G = -inf: that token is simply never picked.
    gumbel = -torch.log(-torch.log(uniforms.to(scores.device)))
    return (scores + gumbel).argmax(dim=-1)


@torch.inference_mode()
def sample_candidates(
    policy: Policy,
    input_ids: Tensor,
    attention_mask: Tensor,
    k: int,
    top_k: int,
    temperature: float,
    max_new_tokens: int,
    generators: Sequence[torch.Generator],
) -> list[list[int]]:
    """Sample ``k`` continuations of each source with top-k and temperature, one KV-cached decoder pass.

    input_ids, attention_mask: [B, S] padded sources. ``generators`` holds B·k generators; row
    ``i * k + j`` (source i, sample j) draws its noise from ``generators[i * k + j]`` only (on that
    generator's device). Returns B·k token-id lists in the same row order, without the decoder start
    token, at most ``max_new_tokens`` long (EOS counted). As in ``generate``, a model whose generation
    config sets ``forced_eos_token_id`` (BART's do) gets that token as the last one of a row that reaches
    the limit; otherwise such a row just stops. ``top_k=0`` samples from the whole vocabulary; ``top_k=1``
    is greedy decoding. The model is used as it is: put it in eval mode first (dropout would otherwise
    perturb the samples).

    The source is encoded once and its states repeated k times; rows that have emitted EOS leave the
    batch (and the cache), so long-tailed lengths cost only what the long rows need.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B, S] and attention_mask the same shape, got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    check_sampling(k, top_k, temperature)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    num_rows = input_ids.shape[0] * k
    if len(generators) != num_rows:
        raise ValueError(f"generators: need one per row (B*k = {num_rows}), got {len(generators)}")
    if num_rows == 0:
        return []

    model = policy.model
    config = model.config
    start_id, eos_id = config.decoder_start_token_id, config.eos_token_id
    if start_id is None or eos_id is None:
        raise ValueError(f"model.config needs decoder_start_token_id and eos_token_id, got {start_id!r}, {eos_id!r}")
    generation_config = getattr(model, "generation_config", None)
    forced_eos_id = getattr(generation_config, "forced_eos_token_id", None)
    if isinstance(forced_eos_id, list | tuple):
        # generate allows any of several ids there, leaving them tied; its argmax takes the smallest.
        forced_eos_id = min(forced_eos_id) if forced_eos_id else None
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    hidden = hidden.repeat_interleave(k, dim=0)  # [B*k, S, H], row i*k+j = source i
    mask = attention_mask.repeat_interleave(k, dim=0)
    rows = list(range(num_rows))  # original row of each still-active row
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    next_tokens = torch.full((num_rows, 1), start_id, dtype=torch.long, device=device)
    cache = None
    for step_index in range(max_new_tokens):
        if step_index == max_new_tokens - 1 and forced_eos_id is not None:
            # The last token of a row still going is forced: no forward pass (or noise) needed for it.
            for row in rows:
                outputs[row].append(forced_eos_id)
            break
        step = model(
            encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
            attention_mask=mask,
            decoder_input_ids=next_tokens,
            past_key_values=cache,
            use_cache=True,
        )
        cache = step.past_key_values
        tokens = _sample_next_tokens(step.logits[:, -1, :], top_k, temperature, [generators[r] for r in rows])
        finished = []
        for pos, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            outputs[row].append(token)
            if token == eos_id:
                finished.append(pos)
        if len(finished) == len(rows):
            break
        if finished:
            done = set(finished)
            keep = [pos for pos in range(len(rows)) if pos not in done]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            hidden, mask, tokens = hidden[index], mask[index], tokens[index]
            rows = [rows[pos] for pos in keep]
        next_tokens = tokens[:, None]
    return outputs


class RolloutWorker:
    """Samples candidate sets with the current policy; a plain class that Ray wraps at launch.

    Version 0 is the policy ``load_policy`` builds (from ``model_cfg``, initial weights seeded with
    ``seed``); :meth:`set_weights` installs the learner's weights under a new version. Results are a
    function of (weights, seed, version, example ids) and the sampling config alone, on a given device
    type: CUDA generators draw other numbers than CPU ones.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        tokenizer_dir: str,
        rollout: RolloutConfig,
        *,
        seed: int,
        max_source_len: int,
        device: str = "cpu",
    ) -> None:
        self.policy = load_policy(model_cfg, tokenizer_dir, seed=seed)
        self.device = torch.device(device)
        self.policy.model.to(self.device).eval()  # sampling never uses dropout
        positions = self.policy.model.config.max_position_embeddings
        if not 2 <= max_source_len <= positions:
            raise ValueError(f"max_source_len={max_source_len} must be in [2, {positions}] ({self.policy.origin})")
        if rollout.max_new_tokens + 1 > positions:  # the decoder start token takes a position too
            raise ValueError(
                f"rollout.max_new_tokens={rollout.max_new_tokens} exceeds the model's {positions} positions"
            )
        self.rollout = rollout
        self.seed = seed
        self.max_source_len = max_source_len
        self._version = 0
        # rollout.backend=ct2: the weights of each version are converted to a CTranslate2 model in a local
        # temporary directory (no shared filesystem needed) the first time that version samples.
        self._ct2 = None
        self._ct2_dir = tempfile.TemporaryDirectory(prefix="rlt2t-ct2-") if rollout.backend == "ct2" else None
        if rollout.backend == "ct2" and self.device.type != "cpu":
            log.warning("rollout.backend=ct2 samples on CPU here (device %s is used by the torch backend only)",
                        self.device)

    def close(self) -> None:
        """Remove the CTranslate2 conversions (the driver calls this before killing the actor)."""
        self._ct2 = None
        if self._ct2_dir is not None:
            self._ct2_dir.cleanup()

    @property
    def version(self) -> int:
        """Version of the weights currently loaded."""
        return self._version

    def set_weights(self, version: int, state_dict: dict[str, Tensor]) -> None:
        """Load the learner's weights (all parameters, strictly) and make ``version`` current."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self.policy.model.load_state_dict(state_dict, strict=True)
        self._version = version
        self._ct2 = None  # converted again, lazily, for the new weights

    def sample(self, examples: Sequence[Example]) -> list[CandidateSet]:
        """One candidate set per example, in order; see :class:`CandidateSet` for what it holds."""
        for i, ex in enumerate(examples):
            if ex.target is None:
                raise ValueError(f"examples[{i}] (id {ex.id!r}) has no target; rank RL needs a reference")
        cfg = self.rollout
        tok = self.policy.tokenizer
        out: list[CandidateSet] = []
        truncated = 0
        for first in range(0, len(examples), cfg.batch_size):
            chunk = examples[first : first + cfg.batch_size]
            ids, n_trunc = encode_texts(tok, [ex.source for ex in chunk], self.max_source_len)
            truncated += n_trunc
            if self._ct2_dir is not None:
                samples = self._sample_ct2(chunk)
            else:
                batch = collate_seq2seq(ids, None, tok.pad_token_id)
                generators = [
                    torch.Generator(device=self.device).manual_seed(stable_seed(self.seed, self._version, ex.id, j))
                    for ex in chunk
                    for j in range(cfg.num_samples)
                ]
                samples = sample_candidates(
                    self.policy, batch["input_ids"], batch["attention_mask"], cfg.num_samples, cfg.top_k,
                    cfg.temperature, cfg.max_new_tokens, generators,
                )
            texts = self.policy.decode(samples)
            for i, ex in enumerate(chunk):
                own = texts[i * cfg.num_samples : (i + 1) * cfg.num_samples]
                out.append(self._candidate_set(ex, own))
        if truncated:
            log.warning("rollout: truncated %d of %d sources to %d tokens", truncated, len(examples),
                        self.max_source_len)
        return out

    def _sample_ct2(self, chunk: Sequence[Example]) -> list[list[int]]:
        """K samples per source with CTranslate2. CT2 seeds a whole call, not each row, so the seed is keyed
        on the chunk's example ids: the driver re-dispatches a chunk whole, and it samples the same again."""
        from rlt2t.common.ct2 import ct2_sampler_from_state_dict, sample_ct2

        cfg = self.rollout
        if self._ct2 is None:
            self._ct2 = ct2_sampler_from_state_dict(
                self.policy, None, self._ct2_dir.name, cfg.ct2_compute_type, intra_threads=torch.get_num_threads(),
                max_source_len=self.max_source_len, name="current")
        seed = stable_seed(self.seed, self._version, "ct2", *(ex.id for ex in chunk)) % (2**31 - 1)
        return sample_ct2(self._ct2, [ex.source for ex in chunk], cfg.num_samples, cfg.top_k, cfg.temperature,
                          cfg.max_new_tokens, seed)

    def _candidate_set(self, ex: Example, samples: Sequence[str]) -> CandidateSet:
        return candidate_set(ex, samples, include_gold=self.rollout.include_gold, seed=self.seed,
                             version=self._version)


def candidate_set(ex: Example, samples: Sequence[str], *, include_gold: bool, seed: int, version: int) -> CandidateSet:
    """A source's candidate set from its samples: gold added, normalised, deduplicated, a pair drawn.

    The pair draw is keyed on (seed, version, example id), so any sampler (Ray actor, policy server)
    that produces the same samples gives the same pair.
    """
    if ex.target is None:
        raise ValueError(f"example {ex.id!r} has no target; rank RL needs a reference")
    pool = list(samples) + ([ex.target] if include_gold else [])
    # dict keeps first-occurrence order: deduplication that does not depend on set iteration order.
    candidates = tuple(dict.fromkeys(t for t in map(normalize_text, pool) if t))
    if len(candidates) >= 2:
        rng = random.Random(stable_seed(seed, version, ex.id, "pair"))
        first, second = rng.sample(candidates, 2)
        pair = (first, second)
    else:
        # One candidate: it is paired with itself and the reward worker turns ranking off for it.
        only = candidates[0] if candidates else ""
        pair = (only, only)
    return CandidateSet(
        example_id=ex.id, source=ex.source, reference=ex.target, candidates=candidates, pair=pair,
        policy_version=version,
    )
