"""Rollout worker: samples K candidates per training source with the current policy, and returns what the
algorithm asks for (``rlt2t.common.types.RolloutSpec``):

- rank RL: the gold target added, candidates deduplicated, the pair the reward worker will score drawn
  (docs/design.md, "The method", step 5);
- policy gradients: the K samples with their token ids and per-token log-probs under the distribution
  sampled from, the reference policy's log-probs of them (the KL to the start), and SCST's greedy decode.

Sampling is reproducible per example: the samples and the pair of an example depend only on the weights
and on (seed, policy version, example id), never on which other examples share the batch or which worker
ran it (``rlt2t.common.sampling``, the sampler the policy server uses too).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlt2t.common.candidates import candidate_set, normalize_text, stable_seed
from rlt2t.common.collate import collate_seq2seq, encode_texts
from rlt2t.common.config import ModelConfig, RolloutConfig
from rlt2t.common.data import Example
from rlt2t.common.families import positions_or
from rlt2t.common.io import pid_running
from rlt2t.common.lora import apply_lora, load_weights, merged_model, reference_policy
from rlt2t.common.policy import Policy, PolicyModel, load_policy
from rlt2t.common.sampling import sample_candidates
from rlt2t.common.scoring import sequence_logprobs
from rlt2t.common.types import CandidateSet, RolloutSpec, SampledGroup

if TYPE_CHECKING:  # imported where used: CTranslate2 loads only with rollout.backend=ct2
    from rlt2t.common.ct2 import Ct2Policy

log = logging.getLogger("rlt2t.rollout")

CT2_DIR_PREFIX = "rlt2t-ct2-"
_CT2_DIR = re.compile(rf"{re.escape(CT2_DIR_PREFIX)}(\d{{1,9}})-[a-z0-9_]+")  # <prefix><owner pid>-<tempfile's suffix>


def sweep_stale_ct2_dirs(root: str | None = None) -> list[str]:
    """Remove the CTranslate2 work directories (``rlt2t-ct2-<pid>-*`` under ``root``, default the temporary
    directory) whose owner process no longer runs: a worker killed outright (OOM, SIGKILL) never reaches
    :meth:`RolloutWorker.close`, and its directory holds a whole converted model. Returns the removed paths."""
    root = root if root is not None else tempfile.gettempdir()
    removed: list[str] = []
    for entry in os.scandir(root):
        match = _CT2_DIR.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not pid_running(int(match[1])):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


StartWeights = dict[str, Tensor] | Callable[[], dict[str, Tensor]]
"""The run's start weights, or a callable that returns them (called once, where they are needed)."""


class RolloutWorker:
    """Samples candidate sets with the current policy; a plain class that Ray wraps at launch.

    Version 0 is the policy ``load_policy`` builds (from ``model_cfg``, initial weights seeded with
    ``seed``); :meth:`set_weights` installs the learner's weights under a new version. Results are a
    function of (weights, seed, version, example ids) and the sampling config alone, on a given device
    type: CUDA generators draw other numbers than CPU ones. With the torch backend each example's samples
    depend on its own id; CTranslate2 seeds a whole call, so there they depend on the ids of the
    ``rollout.batch_size`` sub-chunk it belongs to (a chunk re-dispatched whole samples the same again).
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
        spec: RolloutSpec | None = None,
        start_weights: StartWeights | None = None,
    ) -> None:
        self.policy = load_policy(model_cfg, tokenizer_dir, seed=seed)
        self.spec = spec or RolloutSpec("pair")
        self.model_cfg, self.tokenizer_dir = model_cfg, tokenizer_dir
        self.lora = model_cfg.lora.enabled
        self.reference: PolicyModel | None = None
        self._has_start = False
        self.mask_model: PolicyModel | None = None
        self._mask_version: int | None = None
        self.device = torch.device(device)
        self.policy.model.to(self.device).eval()  # type: ignore[arg-type]  # no dropout when sampling; as below
        positions = positions_or(self.policy.model.config)  # T5: relative positions, no limit
        if not 2 <= max_source_len <= positions:
            raise ValueError(f"max_source_len={max_source_len} must be in [2, {positions}] ({self.policy.origin})")
        if rollout.max_new_tokens > positions:  # the start token takes the first; the last decoded is not fed back
            raise ValueError(f"rollout.max_new_tokens={rollout.max_new_tokens} exceeds the model's {positions} "
                             f"positions: set rollout.max_new_tokens={positions} or lower")
        self.rollout = rollout
        self.seed = seed
        self.max_source_len = max_source_len
        self._version = 0
        self._installed: int | None = None  # the constructor's weights are not any published version
        # rollout.backend=ct2: the weights of each version are converted to a CTranslate2 model in a local
        # temporary directory (no shared filesystem needed) the first time that version samples. Its name holds
        # this process's id, so that a later worker removes it should this one die before close().
        self._ct2: Ct2Policy | None = None
        self._ct2_dir: tempfile.TemporaryDirectory[str] | None = None
        if rollout.backend == "ct2":
            sweep_stale_ct2_dirs()
            self._ct2_dir = tempfile.TemporaryDirectory(prefix=f"{CT2_DIR_PREFIX}{os.getpid()}-")
        if start_weights is not None:
            self._install_start(start_weights)

    @property
    def needs_start(self) -> bool:
        """Whether the run's start weights are still to be installed (the KL's reference, LoRA's base)."""
        return (self.spec.reference or self.lora) and not self._has_start

    def _install_start(self, start_weights: StartWeights) -> None:
        """The run's start: the frozen reference that scores the samples for the KL (with LoRA, the base with
        the adapters disabled; otherwise one copy here, none on the learner ranks), and the base that LoRA's
        published adapters adapt. A callable is called here, once: the Ray launch passes one that fetches the
        weights from the object store, so that neither the constructor's arguments (which Ray keeps for
        restarts) nor every sampling call carry them."""
        if not (self.spec.reference or self.lora) or self._has_start:
            return
        weights = start_weights() if callable(start_weights) else start_weights
        if self.lora:
            # Published versions are adapters only: the base they adapt is the run's start, held once.
            self.policy.model.load_state_dict(weights, strict=True)
            self.policy.model = apply_lora(self.policy.model, self.model_cfg.lora, seed=self.seed)
            self.policy.model.to(self.device).eval()
            self._installed = None  # the adapters just made are no published version
        if self.spec.reference and not self.lora:
            self.reference = load_policy(self.model_cfg, self.tokenizer_dir, seed=self.seed).model
            self.reference.load_state_dict(weights, strict=True)
            # transformers' @wraps(nn.Module.to) makes mypy read PreTrainedModel.to unbound (self unfilled)
            self.reference.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self._has_start = True

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
        self._check_start()
        load_weights(self.policy.model, state_dict)
        self._version = version
        self._installed = version
        self._ct2 = None  # converted again, lazily, for the new weights

    def sample_version(self, version: int, weights: dict[str, Tensor], examples: Sequence[Example],
                       mask_version: int | None = None, mask_weights: dict[str, Tensor] | None = None,
                       start_weights: StartWeights | None = None) -> list[CandidateSet] | list[SampledGroup]:
        """Install the run's start weights if this worker has none yet (``start_weights``, see
        :meth:`_install_start`), the published weights of ``version`` unless they are the ones loaded (and NLPO's
        masking policy, the weights of ``mask_version``), then :meth:`sample`. The driver ships each chunk with
        its version's weights (object-store references, resolved by Ray as top-level arguments) and the start's
        fetcher, so a worker restarted by Ray needs nothing special."""
        if start_weights is not None:
            self._install_start(start_weights)
        if version != self._installed:
            self.set_weights(version, weights)
        if mask_version is not None and mask_version != self._mask_version:
            if mask_weights is None:
                raise ValueError(f"mask_version={mask_version} needs its weights")
            if self.mask_model is None:
                self.mask_model = copy.deepcopy(self.policy.model).eval()
            load_weights(self.mask_model, mask_weights)
            self._mask_version = mask_version
        return self.sample(examples)

    def pid(self) -> int:
        """The worker's process id (tests kill it to exercise re-dispatch)."""
        return os.getpid()

    def _check_start(self) -> None:
        if self.needs_start:
            raise ValueError("the rollout worker needs the run's start weights (the reference of the KL, the base of "
                             "LoRA adapters): pass start_weights to the constructor or to sample_version")

    def sample(self, examples: Sequence[Example]) -> list[CandidateSet] | list[SampledGroup]:
        """One candidate set (rank RL) or sampled group (policy gradients) per example, in order."""
        self._check_start()
        if self.spec.kind == "group":
            return self.sample_groups(examples)
        return self.sample_sets(examples)

    def sample_sets(self, examples: Sequence[Example]) -> list[CandidateSet]:
        """K samples per example made into its candidate set (the rank pair drawn), in order."""
        k = self.rollout.num_samples
        out: list[CandidateSet] = []
        for chunk, batch in self._chunks(examples):
            texts = self.policy.decode(self._sample_rows(chunk, batch, with_logprobs=False))
            out.extend(self._candidate_set(ex, texts[i * k : (i + 1) * k]) for i, ex in enumerate(chunk))
        return out

    def sample_groups(self, examples: Sequence[Example]) -> list[SampledGroup]:
        """K samples per example with their per-token log-probs (:class:`SampledGroup`), in order."""
        cfg = self.rollout
        k = cfg.num_samples
        out: list[SampledGroup] = []
        for chunk, batch in self._chunks(examples):
            rows = self._sample_rows(chunk, batch, with_logprobs=True)
            reference = None
            if self.spec.reference:
                reference = self._reference_logprobs(batch, [r.token_ids for r in rows], k)
            greedy = None
            if self.spec.greedy_baseline:
                greedy_rows = sample_candidates(self.policy.model, batch["input_ids"], batch["attention_mask"], 1, 1,
                                                1.0, cfg.max_new_tokens, self._generators(chunk, 1))
                greedy = self.policy.decode([r.token_ids for r in greedy_rows])
            texts = self.policy.decode([r.token_ids for r in rows])
            for i, ex in enumerate(chunk):
                own = rows[i * k : (i + 1) * k]
                out.append(SampledGroup(
                    example_id=ex.id, source=ex.source, reference=ex.target or "", references=ex.references,
                    fields=ex.extra, candidates=tuple(texts[i * k : (i + 1) * k]),
                    token_ids=tuple(tuple(r.token_ids) for r in own),
                    sample_logprobs=tuple(tuple(r.sample_logprobs) for r in own),
                    forced_eos=tuple(r.forced for r in own),
                    policy_version=self._version,
                    reference_logprobs=None if reference is None else tuple(
                        tuple(x) for x in reference[i * k : (i + 1) * k]),
                    greedy=None if greedy is None else normalize_text(greedy[i]),
                    mask_version=self._mask_version if self.mask_model is not None else None))
        return out

    def _chunks(self, examples: Sequence[Example]) -> Iterator[tuple[Sequence[Example], dict[str, Tensor]]]:
        """``examples`` in chunks of ``rollout.batch_size``, each with its sources encoded and collated."""
        tok = self.policy.tokenizer
        truncated = 0
        for first in range(0, len(examples), self.rollout.batch_size):
            chunk = examples[first : first + self.rollout.batch_size]
            ids, n_trunc = encode_texts(tok, [ex.source for ex in chunk], self.max_source_len)
            truncated += n_trunc
            yield chunk, collate_seq2seq(ids, None, tok.pad_token_id)
        if truncated:
            # The driver reports truncation once per epoch; per chunk it would flood the log.
            log.debug("rollout: truncated %d of %d sources to %d tokens", truncated, len(examples),
                      self.max_source_len)

    def _sample_rows(self, chunk: Sequence[Example], batch: dict[str, Tensor], with_logprobs: bool):
        """K samples per source of ``chunk`` (row ``i * k + j``: source i, sample j) from CTranslate2 or the
        torch sampler: :class:`SampledSequence` rows with ``with_logprobs``, else token-id lists."""
        cfg = self.rollout
        if self._ct2_dir is not None:
            return self._sample_ct2(chunk, with_logprobs)
        rows = sample_candidates(
            self.policy.model, batch["input_ids"], batch["attention_mask"], cfg.num_samples, cfg.top_k,
            cfg.temperature, cfg.max_new_tokens, self._generators(chunk, cfg.num_samples), top_p=cfg.top_p,
            mask_model=self.mask_model, mask_top_p=self.spec.mask_top_p)
        return rows if with_logprobs else [r.token_ids for r in rows]

    def _reference_logprobs(self, batch: dict[str, Tensor], rows: list[list[int]], k: int) -> list[list[float]]:
        if self.reference is not None:
            return sequence_logprobs(self.reference, batch["input_ids"], batch["attention_mask"], rows, k)
        with reference_policy(self.policy.model):  # LoRA: the base, adapters disabled
            return sequence_logprobs(self.policy.model, batch["input_ids"], batch["attention_mask"], rows, k)

    def _generators(self, chunk: Sequence[Example], k: int) -> list[torch.Generator]:
        """Row ``i * k + j`` draws from a generator keyed on (seed, version, example id, j) alone."""
        return [torch.Generator(device=self.device).manual_seed(stable_seed(self.seed, self._version, ex.id, j))
                for ex in chunk for j in range(k)]

    def _sample_ct2(self, chunk: Sequence[Example], with_logprobs: bool = False):
        """K samples per source with CTranslate2. CT2 seeds a whole call, not each row, so the seed is keyed
        on the chunk's example ids: the driver re-dispatches a chunk whole, and it samples the same again."""
        from rlt2t.common.ct2 import ct2_sampler_from_state_dict, sample_ct2, sample_ct2_logprobs

        cfg = self.rollout
        assert self._ct2_dir is not None, "rollout.backend=ct2 makes the directory"
        if self._ct2 is None:
            policy = self.policy
            if self.lora:  # CTranslate2 converts plain models: the adapters merged into a copy of the base
                policy = Policy(merged_model(self.policy.model), self.policy.tokenizer, self.policy.origin)
            self._ct2 = ct2_sampler_from_state_dict(
                policy, None, self._ct2_dir.name, cfg.ct2_compute_type, intra_threads=torch.get_num_threads(),
                max_source_len=self.max_source_len, name="current", device=self._ct2_device())
        seed = stable_seed(self.seed, self._version, "ct2", *(ex.id for ex in chunk)) % (2**31 - 1)
        if with_logprobs:
            return sample_ct2_logprobs(self._ct2, [ex.source for ex in chunk], cfg.num_samples, cfg.top_k,
                                       cfg.temperature, cfg.max_new_tokens, seed, top_p=cfg.top_p)
        return sample_ct2(self._ct2, [ex.source for ex in chunk], cfg.num_samples, cfg.top_k, cfg.temperature,
                          cfg.max_new_tokens, seed, top_p=cfg.top_p)

    def _ct2_device(self) -> str:
        """Where CTranslate2 samples: this worker's GPU (rl.rollout_gpus) when the CTranslate2 build sees one,
        else the CPU (with a warning once)."""
        if self.device.type != "cuda":
            return "cpu"
        import ctranslate2

        if ctranslate2.get_cuda_device_count() > 0:
            return "cuda"
        if not getattr(self, "_warned_ct2_cpu", False):
            log.warning("rollout.backend=ct2: this CTranslate2 build sees no CUDA device; it samples on the CPU "
                        "(the torch backend samples on %s)", self.device)
            self._warned_ct2_cpu = True
        return "cpu"

    def _candidate_set(self, ex: Example, samples: Sequence[str]) -> CandidateSet:
        if ex.target is None:
            raise ValueError(f"example {ex.id!r} has no target; rank RL needs a reference")
        return candidate_set(ex.id, ex.source, ex.target, samples, include_gold=self.rollout.include_gold,
                             seed=self.seed, version=self._version, references=ex.references, fields=ex.extra)


