"""The one sampler: K continuations per source, each decoder row seeded on its own, with per-token
log-probs of the raw model and of the distribution actually sampled from.

Rollout workers (``rlt2t.actors.rollout``) and the policy server's torch backend
(``rlt2t.services.backends``) both call :func:`sample_candidates`; the rank pair is drawn by
:func:`rlt2t.common.candidates.candidate_set` wherever candidates are produced. Why a sampler of our own
instead of Hugging Face ``generate``: ``generate`` draws from the global RNG, so a row's sample would depend
on which other rows share its batch. Here every row has its own ``torch.Generator`` and samples with the
Gumbel-max trick, so the samples of an example depend only on the weights and on the seed its caller derives
(usually ``stable_seed(seed, policy version, example id, j)``).

Top-k, top-p and epsilon are transformers' own logits warpers (:func:`warp_logits`); the learner applies the same
function to its teacher-forced logits, so a policy-gradient ratio compares the learner's and the sampler's
log-probs under one transform (docs/design.md, "Behaviour log-probs").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.generation.logits_process import EpsilonLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.modeling_outputs import BaseModelOutput

from rlt2t.common.families import cache_of, with_cache


def check_sampling(k: int, top_k: int, temperature: float, top_p: float = 1.0, epsilon: float = 0.0) -> None:
    """The sampling arguments every sampler (torch or CTranslate2) shares."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {top_k}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"epsilon must be in [0, 1) (0: no epsilon filter), got {epsilon}")


def warp_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                epsilon: float = 0.0) -> Tensor:
    """Logits [..., V] -> the scores sampling draws from: divided by ``temperature``, then what top-k, then top-p,
    then epsilon exclude set to -inf (ties with the k-th score are kept; epsilon removes the tokens whose
    probability, after the filters before it, is under ``epsilon``, keeping the most likely one). At least float32.

    transformers' warpers, so the filter is the one ``generate`` applies; they take 2-D scores, so any
    leading dims are flattened and restored.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp16/bf16 logits: sample in fp32
    scores = logits.to(dtype) / temperature
    shape = scores.shape
    flat = scores.reshape(-1, shape[-1])
    if 0 < top_k < shape[-1]:
        flat = TopKLogitsWarper(top_k)(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p)(None, flat)
    if epsilon > 0.0:
        flat = EpsilonLogitsWarper(epsilon)(None, flat)
    return flat.reshape(shape)


@dataclass(frozen=True)
class SampledSequence:
    """One sampled row: its token ids (no decoder start; EOS last when produced) and, per token, the raw
    model log-prob (temperature 1, no filter: what reranking and scoring use) and the log-prob under the
    warped distribution the token was drawn from (what a policy-gradient ratio needs)."""

    token_ids: list[int]
    logprobs: list[float]
    sample_logprobs: list[float]
    forced: bool = False
    """The last token is the EOS forced at the length limit, not drawn (its sample log-prob is 0)."""


def _forced_eos_id(model) -> int | None:
    forced = getattr(getattr(model, "generation_config", None), "forced_eos_token_id", None)
    if isinstance(forced, list | tuple):
        # generate allows any of several ids there, leaving them tied; its argmax takes the smallest.
        forced = min(forced) if forced else None
    return forced


@torch.inference_mode()
def sample_candidates(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    k: int,
    top_k: int,
    temperature: float,
    max_new_tokens: int,
    generators: Sequence[torch.Generator],
    *,
    top_p: float = 1.0,
    epsilon: float = 0.0,
    mask_model=None,
    mask_top_p: float = 1.0,
    between_steps: Callable[[], Collection[int]] | None = None,
) -> list[SampledSequence]:
    """Sample ``k`` continuations of each source (temperature, top-k, top-p, epsilon), one KV-cached decoder pass.

    model: a Hugging Face encoder-decoder (eval mode: dropout would perturb the samples).
    input_ids, attention_mask: [B, S] padded sources. ``generators`` holds B·k generators; row ``i * k + j``
    (source i, sample j) draws its noise from ``generators[i * k + j]`` only (on that generator's device):
    Gumbel-max, argmax(scores + G) with G = -log(-log U), an exact sample of softmax(scores), V uniforms per
    row per step. Returns B·k rows in that order, at most ``max_new_tokens`` tokens long (EOS counted). As in
    ``generate``, a model whose generation config sets ``forced_eos_token_id`` (BART's do) gets that token
    as the last one of a row that reaches the limit (its sample log-prob is 0: it was not drawn);
    otherwise such a row just stops. ``top_k=0`` samples from the whole vocabulary; ``top_k=1`` is greedy.

    ``mask_model`` (NLPO): a second encoder-decoder decoded in lock-step; at each step only the tokens in
    its top-``mask_top_p`` set are allowed (the mask is applied to the logits before temperature, top-k,
    top-p and epsilon), and the sample log-prob is under that masked distribution.

    The source is encoded once and its states repeated k times; rows that have emitted EOS leave the
    batch (and the cache), so long-tailed lengths cost only what the long rows need.

    ``between_steps``, when given, is called after every decoding step; the rows it returns (indices into
    the B·k rows) leave the batch and its cache at once, keeping the tokens drawn so far. The policy
    server drops requests that are gone this way (and runs waiting work inside the call).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B, S] and attention_mask the same shape, got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    check_sampling(k, top_k, temperature, top_p, epsilon)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    num_rows = input_ids.shape[0] * k
    if len(generators) != num_rows:
        raise ValueError(f"generators: need one per row (B*k = {num_rows}), got {len(generators)}")
    if num_rows == 0:
        return []

    config = model.config
    start_id, eos_id = config.decoder_start_token_id, config.eos_token_id
    if start_id is None or eos_id is None:
        raise ValueError(f"model.config needs decoder_start_token_id and eos_token_id, got {start_id!r}, {eos_id!r}")
    forced_eos_id = _forced_eos_id(model)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)

    hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    hidden = hidden.repeat_interleave(k, dim=0)  # [B*k, S, H], row i*k+j = source i
    mask = attention_mask.repeat_interleave(k, dim=0)
    mask_hidden: Tensor | None = None
    mask_cache = None
    if mask_model is not None:
        mask_hidden = mask_model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask_hidden = mask_hidden.repeat_interleave(k, dim=0)
    rows = list(range(num_rows))  # original row of each still-active row
    tokens_out: list[list[int]] = [[] for _ in range(num_rows)]
    raw_out: list[list[float]] = [[] for _ in range(num_rows)]
    sample_out: list[list[float]] = [[] for _ in range(num_rows)]
    next_tokens = torch.full((num_rows, 1), start_id, dtype=torch.long, device=device)
    cache = None
    for step_index in range(max_new_tokens):
        step = model(encoder_outputs=BaseModelOutput(last_hidden_state=hidden), attention_mask=mask,
                     decoder_input_ids=next_tokens, **with_cache(cache))
        cache = cache_of(step)
        logits = step.logits[:, -1, :]
        raw = logits.float().log_softmax(dim=-1)
        if mask_model is not None:
            mask_step = mask_model(encoder_outputs=BaseModelOutput(last_hidden_state=mask_hidden), attention_mask=mask,
                                   decoder_input_ids=next_tokens, **with_cache(mask_cache))
            mask_cache = cache_of(mask_step)
            allowed = torch.isfinite(warp_logits(mask_step.logits[:, -1, :], top_p=mask_top_p))
            logits = logits.masked_fill(~allowed, float("-inf"))
        last = step_index == max_new_tokens - 1
        if last and forced_eos_id is not None:
            # The last token of a row still going is forced, not drawn: no noise is consumed for it.
            tokens = torch.full((len(rows),), forced_eos_id, dtype=torch.long, device=device)
            drawn = torch.zeros(len(rows), device=device)
        else:
            scores = warp_logits(logits, temperature, top_k, top_p, epsilon)
            uniforms = torch.stack([torch.rand(scores.shape[-1], generator=generators[r], device=device,
                                               dtype=scores.dtype) for r in rows])
            # U = 0 (rand's range is [0, 1)) would give G = -inf: where it fell on the one token the filters left,
            # every score was -inf and argmax drew token 0 at log-prob -inf. The smallest normal float instead.
            uniforms = uniforms.clamp(min=torch.finfo(uniforms.dtype).tiny)
            tokens = (scores - torch.log(-torch.log(uniforms))).argmax(dim=-1)
            drawn = scores.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
        raw_chosen = raw.gather(-1, tokens[:, None])[:, 0].tolist()
        drawn_chosen = drawn.tolist()
        finished = []
        for pos, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            tokens_out[row].append(token)
            raw_out[row].append(raw_chosen[pos])
            sample_out[row].append(drawn_chosen[pos])
            if token == eos_id:
                finished.append(pos)
        if between_steps is not None and not last and (stopped := set(between_steps())):
            finished += [pos for pos, row in enumerate(rows) if row in stopped and tokens_out[row][-1] != eos_id]
        if len(finished) == len(rows) or last:
            break
        if finished:
            done = set(finished)
            keep = [pos for pos in range(len(rows)) if pos not in done]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            hidden, mask, tokens = hidden[index], mask[index], tokens[index]
            if mask_cache is not None and mask_hidden is not None:  # both set from the first step on
                mask_cache.batch_select_indices(index)
                mask_hidden = mask_hidden[index]
            rows = [rows[pos] for pos in keep]
        next_tokens = tokens[:, None]
    forced = [forced_eos_id is not None and len(t) == max_new_tokens for t in tokens_out]
    return [SampledSequence(t, r, s, f) for t, r, s, f in zip(tokens_out, raw_out, sample_out, forced, strict=True)]
