"""The ranks a pretraining or SFT stage trains on (``strategy`` ddp or fsdp), as :func:`train_stage` sees them.

Every rank runs the same loop (Ray actors that joined one process group: ``rlt2t.stage_group``); this class holds
what differs from one process. A global batch of ``batch_size`` examples is split between the ranks (rank r takes
every world-th example from the r-th; a rank left without one, in an epoch's last short batch, repeats one, as
torch's ``DistributedSampler`` pads). DDP averages the gradients over the ranks; FSDP2 shards the model as the RL
learner does (``sharding.shard``: one unit per layer, the model under a :class:`ForwardRoot`). The logged metrics
are the ranks' mean, so every rank sees the same loss and stops alike; the validation scores are rank 0's, sent to
the others. Rank 0 writes logs and checkpoints: the whole model (gathered from the shards under FSDP); each rank
writes its own state (its RNG, and under FSDP its optimizer shard) into the checkpoint rank 0 is writing.

``local`` (one process, the default): every method is what the single-process loop did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from rlt2t.common.checkpoint import rng_state
from rlt2t.common.config import FSDPConfig
from rlt2t.common.lora import is_lora
from rlt2t.learner import sharding

T = TypeVar("T")


def stage_section(stage: str) -> str:
    """The config section whose ``strategy`` places ``stage`` (continued SFT follows ``sft``'s)."""
    return "sft" if stage == "continued_sft" else stage


class ForwardRoot(nn.Module):
    """The root FSDP unit of a model trained through its own forward (the stages' ``model(**batch)``): it holds
    what no layer owns (embeddings, LM head, final norms) and leaves the model's own class unchanged, so that its
    checkpoints name the Hugging Face class (``fully_shard`` changes the class of the module it shards). A
    training pass keeps no decoder cache: a layer whose activations are recomputed in the backward
    (rl.fsdp.activation_checkpointing) must compute the same thing twice."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> Any:
        return self.model(**batch, use_cache=False)


@dataclass
class StageRanks:
    strategy: str = "local"
    rank: int = 0
    world: int = 1
    objects: Any = None
    """The process group picklable objects travel over: a gloo group beside nccl (not through GPU memory);
    None: the default group."""

    @classmethod
    def current(cls, strategy: str, stage: str) -> StageRanks:
        """This process's place: one rank (``local``), or its rank in the initialised process group."""
        if strategy == "local":
            return cls()
        if not dist.is_initialized():
            raise RuntimeError(f"{stage_section(stage)}.strategy={strategy}: the stage trains on ranks of one process "
                               "group (rlt2t.stage_group.run_on_ranks starts them); none is initialised here")
        objects = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        return cls(strategy, dist.get_rank(), dist.get_world_size(), objects)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy != "local"

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    def layout(self) -> dict[str, Any]:
        """What a checkpoint records of the ranks that wrote it ({} for one process: its meta as it always was)."""
        return {"strategy": self.strategy, "ranks": self.world} if self.distributed else {}

    def check_layout(self, stage: str, path: Any, meta: dict[str, Any]) -> None:
        """A checkpoint resumes on the ranks that wrote it: a rank's optimizer shard and RNG are its own."""
        saved = {"strategy": meta.get("strategy", "local"), "ranks": meta.get("ranks", 1)}
        here = {"strategy": self.strategy, "ranks": self.world}
        if saved != here:
            key = f"{stage_section(stage)}.strategy"
            raise ValueError(f"{stage}: {path} was written by {saved['ranks']} rank(s) under {key}="
                             f"{saved['strategy']}, this run has {self.world} under {key}={self.strategy}"
                             f"; resume with the same {key} and rl.learners, or train into another directory")

    def share(self, indices: Sequence[int]) -> list[int]:
        """This rank's part of a global batch's example indices."""
        if not self.distributed:
            return list(indices)
        mine = list(indices[self.rank::self.world])
        return mine or [indices[self.rank % len(indices)]]

    def mean(self, metrics: dict[str, float], device: torch.device) -> dict[str, float]:
        """The ranks' mean of each metric (every rank logs the same names: they run the same step function)."""
        if not self.distributed:
            return metrics
        values = torch.tensor([metrics[k] for k in sorted(metrics)], dtype=torch.float64, device=device)
        dist.all_reduce(values)
        return {k: float(v) / self.world for k, v in zip(sorted(metrics), values.tolist(), strict=True)}

    def from_main(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (validation scores: every rank then keeps and stops alike)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def shard(self, model: nn.Module, stage: str, fsdp: FSDPConfig, device: torch.device,
              mixed_precision: str) -> nn.Module:
        """Under FSDP: ``model`` sharded in place, returned under the :class:`ForwardRoot` the stage trains
        through; otherwise ``model`` itself. Before the optimizer is built (the parameters become shards)."""
        if not self.sharded:
            return model
        root = ForwardRoot(model)
        sharding.shard(root, model, fsdp, device=device, mixed_precision=mixed_precision,
                       key=f"{stage_section(stage)}.strategy")
        return root

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float, accelerator: Accelerator) -> float:
        if self.sharded:
            return sharding.clip_grad_norm(params, max_norm)
        return float(accelerator.clip_grad_norm_(params, max_norm))

    @contextlib.contextmanager
    def whole(self, trained: nn.Module, fsdp: FSDPConfig) -> Iterator[None]:
        """The model's weights whole for a pass outside training (validation: ``generate``); a collective."""
        if not self.sharded:
            yield
            return
        with sharding.gathered(trained, fsdp.reshard_after_forward):
            yield

    def saved_model(self, trained: nn.Module, model: nn.Module) -> Any:
        """What ``save_checkpoint`` saves: ``model``, or under FSDP its whole weights gathered from the shards
        (a LoRA policy's adapters alone, as it saves them; a collective: rank 0 gets the object to save)."""
        if not self.sharded:
            return model
        state = sharding.full_trainable_state(model) if is_lora(model) else sharding.full_state(trained, model)
        return sharding.Consolidated(model, state)

    def rank_file(self, rank: int) -> str:
        """The file of a checkpoint that holds rank ``rank``'s own state."""
        return f"training_state.rank{rank}.pt"

    def training_state(self, optimizer: torch.optim.Optimizer, shared: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's training state (rank 0 saves it): ``shared`` (the same on every rank) with the
        optimizer's state, one process's keys as they always were, its RNG included. Several ranks: the RNG (and
        under FSDP the optimizer shard) is each rank's own, in its own file (:meth:`own_state`)."""
        if not self.distributed:
            return {"optimizer": optimizer.state_dict(), **shared, "rng": rng_state()}
        return shared if self.sharded else {**shared, "optimizer": optimizer.state_dict()}

    def write_own(self, optimizer: torch.optim.Optimizer, directory: Path | None) -> None:
        """Every rank's own state into the checkpoint rank 0 is writing (``directory``: where, on rank 0; None
        on the others): rank 0 sends the path, each rank writes its file there (on the filesystem every rank
        shares), and rank 0 marks the checkpoint complete only after all have (a collective)."""
        if not self.distributed:
            return
        directory = Path(self.from_main(str(directory) if directory is not None else ""))
        own: dict[str, Any] = {"rng": rng_state()}
        if self.sharded:
            own["optimizer"] = sharding.local_optimizer_state(optimizer.state_dict())
        torch.save(own, directory / self.rank_file(self.rank))
        self.from_main(None)  # every rank's file is written

    def own_state(self, path: Path, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of the training state of checkpoint ``path``, its optimizer state loaded (resharded
        under FSDP); returns the part (its RNG)."""
        own = torch.load(path / self.rank_file(self.rank), map_location="cpu", weights_only=False) \
            if self.distributed else state
        optimizer.load_state_dict(own["optimizer"] if "optimizer" in own else state["optimizer"])
        if self.sharded:
            sharding.reshard_optimizer_state(optimizer)
        return own
