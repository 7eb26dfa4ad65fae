"""Search's repetition and length controls for transformers' ``generate`` (beam search, greedy as a beam of one):
what ``predict.*`` gives the torch backend's beams and ``eval.*`` gives `rlt2t eval`'s decode. CTranslate2 takes
the same four as ``translate_batch`` arguments (:class:`rlt2t.common.ct2.Ct2Policy`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import LogitsProcessor, LogitsProcessorList

REPETITION_CONTROLS = {"no_repeat_ngram_size": 0, "repetition_penalty": 1.0}
"""The repetition controls, by field: the value that switches each off."""
SEARCH_CONTROLS = {**REPETITION_CONTROLS, "length_penalty": 1.0, "min_new_tokens": 0}
"""The repetition and length controls, by field: the value that leaves the search as it is (samples are drawn
from the model's own distribution, without them)."""


class GeneratedRepetition(LogitsProcessor):
    """The repetition controls over the tokens a hypothesis has generated (as CTranslate2 counts them):
    ``no_repeat_ngram_size`` n (0: off) bans each token that would complete an n-gram the hypothesis already holds;
    ``repetition_penalty`` (1: off) scales down the score (in beam search, the log-prob) of each token it already
    holds (multiplied when negative, divided when positive). The decoder start token is not one of them:
    transformers' own processors count it, and in the BART family it is the EOS, which they would then penalise
    from the first step (and ban for good with n = 1, so that no hypothesis ends)."""

    def __init__(self, no_repeat_ngram_size: int, repetition_penalty: float) -> None:
        if no_repeat_ngram_size < 0 or not repetition_penalty > 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0 and repetition_penalty > 0, got "
                             f"{no_repeat_ngram_size}, {repetition_penalty}")
        self.n, self.penalty = no_repeat_ngram_size, repetition_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, 1:]
        if generated.shape[1] == 0:
            return scores
        if self.penalty != 1.0:
            held = torch.gather(scores, 1, generated)
            scores = cast(torch.FloatTensor, scores.scatter(1, generated, torch.where(
                held < 0, held * self.penalty, held / self.penalty)))
        n = self.n
        if n and generated.shape[1] >= n - 1:
            for row, seq in enumerate(generated.tolist()):
                last = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
                banned = {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i : i + n - 1]) == last}
                if banned:
                    scores[row, sorted(banned)] = float("-inf")
        return scores


def search_arguments(*, no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0, length_penalty: float = 1.0,
                     min_new_tokens: int = 0) -> tuple[dict[str, Any], LogitsProcessorList]:
    """The controls as ``generate`` takes them: generation settings (``length_penalty``, ``min_new_tokens``) and
    the logits processors (:class:`GeneratedRepetition` when a repetition control is on, else none)."""
    settings = {"length_penalty": length_penalty, "min_new_tokens": min_new_tokens or None}
    repeats = (no_repeat_ngram_size, repetition_penalty) != tuple(REPETITION_CONTROLS.values())
    return settings, LogitsProcessorList([GeneratedRepetition(no_repeat_ngram_size, repetition_penalty)]
                                         if repeats else [])
