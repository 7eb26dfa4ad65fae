"""The pretraining and SFT stages on several ranks (``pretrain.strategy`` / ``sft.strategy`` = ddp or fsdp).

The job's driver starts rl.learners Ray actors in one placement group of the RL learner's bundles
(rl.learner_cpus, rl.learner_gpus, rl.learner_resources), forms their process group at rank 0's address (gloo
on the CPU, nccl on GPUs), and each rank calls the stage's own job function (``rlt2t.jobs.STAGE_JOBS``), which
finds itself on a rank and trains through ``train_stage``'s ranks (``rlt2t.learner.stage_ranks``). The stage's
result is rank 0's. The ranks read the run's data and tokenizer and write its checkpoints in run.dir: each first
checks that it sees the driver's run.dir, so a cluster without a shared filesystem fails at once, saying so.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlt2t.common.checkpoint import resume_point
from rlt2t.common.config import Config
from rlt2t.groups import ClusterTooSmall, init_ray, unschedulable
from rlt2t.learner.stage_ranks import stage_section
from rlt2t.learner.trainer import StageResult

log = logging.getLogger("rlt2t.stages")


class StageRank:
    """One rank of a stage: a Ray actor that joins the stage's process group and runs the stage's job."""

    def __init__(self, rank: int, world: int, threads: int):
        from rlt2t.common.tracking import setup_logging

        setup_logging(logging.INFO if rank == 0 else logging.WARNING)  # rank 0 tells the stage's progress
        import torch

        self.rank, self.world = rank, world
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # or accelerate resets the thread count

    def address(self) -> tuple[str, int]:
        from rlt2t.learner.learner import free_address

        return free_address()

    def run(self, stage: str, cfg: Config, resume: bool, init: str | None, rendezvous: tuple[str, int],
            token: str) -> StageResult:
        import torch
        import torch.distributed as dist

        from rlt2t import jobs

        check_sees_run_dir(stage, self.rank, Path(cfg.run.dir), token)
        cuda = bool(cfg.rl.learner_gpus) and torch.cuda.is_available()
        if not cuda:  # a rank without a GPU of its own trains on the CPU, whatever run.device says
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"device": "cpu"})})
        address, port = rendezvous
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(minutes=10))
        # What accelerate reads to find the group (each actor sees its own GPU alone: local rank 0).
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=address, MASTER_PORT=str(port))
        return jobs.STAGE_JOBS[stage](cfg, resume=resume, init=init)


def check_sees_run_dir(stage: str, rank: int, run_dir: Path, token: str) -> None:
    """A rank must see the driver's run.dir (``token``: the file the driver wrote there for this stage)."""
    if not (run_dir / token).is_file():
        raise FileNotFoundError(f"{stage} rank {rank} on {ray.util.get_node_ip_address()} does not see the driver's "
                                f"run.dir {run_dir}: a stage on several ranks reads its data and writes its "
                                f"checkpoints there; mount it at that path on every node, or set "
                                f"{stage_section(stage)}.strategy=local")


def run_on_ranks(cfg: Config, stage: str, resume: bool, init: str | Path | None) -> StageResult:
    """Run ``stage`` (a key of ``rlt2t.jobs.STAGE_JOBS``) on rl.learners ranks; returns rank 0's result. A
    rank's error in the user's input (a ValueError or OSError: config, data, files) is raised here as it is."""
    resume_point(cfg.run_dir / stage / "checkpoints", resume)  # a run that would write over one: refused now
    init_ray(cfg)
    r = cfg.rl
    strategy = getattr(cfg, stage_section(stage)).strategy
    bundle = {"CPU": r.learner_cpus, **({"GPU": r.learner_gpus} if r.learner_gpus else {}), **r.learner_resources}
    group = placement_group([bundle] * r.learners, strategy="PACK")
    token = cfg.run_dir / f".stage-ranks-{uuid.uuid4().hex}"  # each rank's proof that it sees run.dir
    ranks: list[Any] = []
    try:
        try:
            ray.get(group.ready(), timeout=r.schedule_timeout_s)
        except GetTimeoutError:
            raise ClusterTooSmall(unschedulable(f"the {stage} ranks ({r.learners} bundles of {bundle}: rl.learners, "
                                                 "rl.learner_cpus / learner_gpus / learner_resources)",
                                                 r.schedule_timeout_s)) from None
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        token.write_text("")
        actor = ray.remote(StageRank)
        ranks = [actor.options(num_cpus=r.learner_cpus, num_gpus=r.learner_gpus, resources=dict(r.learner_resources),
                               max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                   placement_group=group, placement_group_bundle_index=i),
                               ).remote(i, r.learners, max(1, int(r.learner_cpus))) for i in range(r.learners)]
        log.info("%s: %d %s ranks (%s each)", stage, r.learners, strategy, bundle)
        rendezvous = ranks[0].address.remote()
        pending = [rank.run.remote(stage, cfg, resume, None if init is None else str(init), rendezvous, token.name)
                   for rank in ranks]
        results = list(pending)
        try:
            while pending:  # the first rank to fail fails the stage: the others would wait on it for ever
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
            return ray.get(results[0])
        except (RayActorError, RayTaskError) as e:
            if isinstance(e, RayTaskError) and isinstance(e.cause, (ValueError, OSError)):
                raise e.cause from None
            raise RuntimeError(f"{stage}: a rank failed ({stage_section(stage)}.strategy={strategy}, rl.learners="
                               f"{r.learners}); --resume continues from its newest checkpoint: {e}") from e
    finally:
        for rank in ranks:
            ray.kill(rank)
        remove_placement_group(group)
        token.unlink(missing_ok=True)
