"""The sharded learner (rl.strategy=fsdp): FSDP2 (``torch.distributed.fsdp.fully_shard``) over the learner ranks.

Each rank holds 1/N of every parameter, of its gradient and of AdamW's moments. The units: every encoder and
decoder layer of the policy (:func:`layer_units`: one rule for every family), then the objective's module as
the root, which keeps what no layer owns (embeddings, LM head,
final norms). A layer's weights are gathered for its forward and its backward and freed after; the root's for
the whole forward. Every pass over the policy must therefore enter through the root's forward (the objectives'
``GroupPolicy`` and ``SharedEncoderRankLoss``; their encoder states are repeated rather than projected outside
the layers, ``repeated_encoder_states``), and every rank must take the same passes, as under DDP.

With rl.fsdp.activation_checkpointing each layer is recomputed in the backward, so its forward must depend on
its inputs alone: no decoder cache (the repeated passes set ``use_cache=False``).

Small modules that are not the policy's (PPO's value head) stay whole on every rank, their gradients averaged
by :func:`average_replicated_grads`, as DDP would. A frozen reference the learner holds (DPO's, or the KL's for
policy servers' samples) is sharded alike, as a root of its own. Under bf16 the sharded parameters compute in
bf16 and their gradients reduce in fp32; on the CPU everything stays fp32.

What leaves a rank stays independent of the sharding: the policy's whole state dict (:func:`full_state`, a
collective, on rank 0), and each rank's optimizer state as plain local tensors (:func:`local_optimizer_state`;
:func:`reshard_optimizer_state` makes them shards again after a load), so a checkpoint is a Hugging Face
directory plus per-rank optimizer shards, written through Ray without a shared filesystem.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlt2t.common.config import FSDPConfig

log = logging.getLogger("rlt2t.learner")


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The model's layers, one FSDP unit each: the elements of its outermost ``nn.ModuleList`` s, which in every
    supported family are the encoder's and the decoder's stacks of layers (BART's ``layers``, T5's ``block``;
    lists inside a layer, T5's sub-layers, belong to their layer)."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before their children
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            units.extend(module)
            inside.update(id(sub) for sub in module.modules())
    return units


def shard(module: nn.Module, policy_model: nn.Module, cfg: FSDPConfig, *, device: torch.device,
          mixed_precision: str, replicated: Iterable[nn.Parameter] = (), key: str = "rl.strategy") -> None:
    """Shard ``module`` (the objective's, holding ``policy_model``) in place over the default process group:
    one FSDP unit per layer of ``policy_model``, then ``module`` as the root. ``replicated``: parameters left
    whole on every rank; ``key``: the setting that asked for it, for the messages. Call before building the
    optimizer (the parameters become DTensors)."""
    layers = layer_units(policy_model)
    if not layers:
        raise ValueError(f"{key}=fsdp: {type(policy_model).__name__} has no stack of layers (nn.ModuleList) "
                         f"to shard by; use {key}=ddp")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if mixed_precision == "bf16" else MixedPrecisionPolicy())
    offload: OffloadPolicy = OffloadPolicy()
    if cfg.cpu_offload:
        if device.type == "cuda":
            offload = CPUOffloadPolicy()
        else:
            log.warning("rl.fsdp.cpu_offload: the learner runs on the CPU already; ignored")
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward, "mp_policy": mp,
                               "offload_policy": offload}
    if cfg.activation_checkpointing:
        layers = _checkpointed(policy_model, layers)
    for layer in layers:
        fully_shard(layer, **options)
    ignored = set(replicated)
    if mixed_precision == "bf16":  # the root's outputs (logits, values) in fp32, as autocast's softmax is under DDP
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                    output_dtype=torch.float32)
    fully_shard(module, **options, ignored_params=ignored or None)
    log.info("%s=fsdp: %d layer units (%s) and the root over %d ranks, %s%s%s", key, len(layers),
             ", ".join(sorted({type(m).__name__ for m in layers})), dist.get_world_size(),
             "bf16 parameters, fp32 reductions" if mixed_precision == "bf16" else "fp32",
             ", activation checkpointing" if cfg.activation_checkpointing else "",
             ", CPU offload" if isinstance(offload, CPUOffloadPolicy) else "")


def _checkpointed(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """Each layer replaced in its stack by a wrapper that recomputes its activations in the backward: torch's
    own (Hugging Face's skips a module in eval mode, and the policy gradients' learner runs in eval mode), as the
    FSDP unit. The wrapper's name leaves the gathered state dict (``get_model_state_dict`` drops it)."""
    wanted = {id(layer) for layer in layers}
    wrapped = []
    for stack in model.modules():
        if isinstance(stack, nn.ModuleList):
            for i, layer in enumerate(stack):
                if id(layer) in wanted:
                    stack[i] = checkpoint_wrapper(layer)
                    wrapped.append(stack[i])
    return wrapped


def prefix_of(module: nn.Module, inner: nn.Module) -> str:
    """The state-dict prefix under which ``inner`` sits in ``module`` ('' when it is ``module``)."""
    for name, sub in module.named_modules():
        if sub is inner:
            return f"{name}." if name else ""
    raise ValueError(f"{type(inner).__name__} is not a submodule of {type(module).__name__}")


def full_state(module: nn.Module, inner: nn.Module) -> dict[str, Tensor]:
    """``inner``'s whole state dict (its own key names) on CPU, gathered from the shards of ``module``: a
    collective every rank calls; rank 0 gets the tensors, the others an empty dict."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = prefix_of(module, inner)
    # One rank on the CPU: the "gathered" tensors are the live parameters themselves; a snapshot must not move.
    alias = dist.get_world_size() == 1
    return {k[len(prefix):]: v.detach().clone() if alias else v for k, v in state.items()
            if k.startswith(prefix) and isinstance(v, Tensor)}


def full_trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` whole, as CPU copies under their ``named_parameters`` names (a LoRA
    policy's adapters: peft's own names, which ``get_peft_model_state_dict`` and ``save_pretrained`` read),
    gathered from the shards: a collective every rank calls; rank 0 gets them, the others an empty dict."""
    rank0 = dist.get_rank() == 0
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if rank0:
                state[name] = whole.detach().to("cpu", copy=True)
    return state


def local_optimizer_state(state: Any) -> Any:
    """An optimizer state dict with each DTensor replaced by this rank's shard, a plain tensor (picklable, no
    mesh); like ``state_dict()`` itself it aliases the live moments (``Learner.training_state`` copies)."""
    if isinstance(state, DTensor):
        return state.to_local().detach()
    if isinstance(state, dict):
        return {k: local_optimizer_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_optimizer_state(v) for v in state]
    return state


def reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of a :func:`local_optimizer_state`: the moments of sharded parameters become
    shards of those parameters again (the same placement as the parameter's)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param, {})
            for key, value in list(state.items()):
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and key != "step":
                    if value.shape != param.to_local().shape:
                        raise ValueError(f"optimizer state {key!r}: a shard of shape {tuple(value.shape)} for a "
                                         f"parameter whose shard here is {tuple(param.to_local().shape)} (saved "
                                         "under another rl.learners or model?)")
                    state[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                    run_check=False, shape=param.shape, stride=param.stride())


def average_replicated_grads(params: Iterable[nn.Parameter]) -> None:
    """DDP's average over the ranks for the gradients of parameters left whole (``shard``'s ``replicated``)."""
    world = dist.get_world_size()
    for param in params:
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of sharded and replicated parameters together to ``max_norm`` (their global norm, as
    under DDP); returns that norm. A collective."""
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if isinstance(p, DTensor)]
    whole = [p for p in params if not isinstance(p, DTensor)]
    if not whole:  # torch's own arithmetic, as under DDP
        norm = torch.nn.utils.clip_grad_norm_(sharded, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    squares = torch.zeros((), dtype=torch.float64)
    for group in (sharded, whole):
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares = squares + norm.double().cpu() ** 2
    total = squares.sqrt()
    for group in (sharded, whole):
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(torch.float32))
    return float(total)


@contextlib.contextmanager
def gathered(module: nn.Module, reshard_after_forward: bool) -> Iterator[None]:
    """Every FSDP unit of ``module`` gathered whole on every rank for the duration (a collective): passes that
    do not enter through the root (``generate``) and differ between ranks (their shards of an evaluation)."""
    # FSDP finds its root at the first forward: when none has run yet (an evaluation before the first step),
    # the layers' forwards inside generate would each take themselves for the root.
    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            unit.reshard()


def rank_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of parameters and optimizer state this rank holds (its shards; replicated parameters whole); a
    frozen model (the reference) has no optimizer."""
    def local_bytes(t: Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local_bytes(p) for p in module.parameters())
    for state in optimizer.state.values() if optimizer is not None else ():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, Tensor))
    return total


class Consolidated:
    """A sharded policy as ``save_checkpoint`` saves it: the model's class and config, the whole weights
    gathered from the ranks (a Hugging Face directory that export, evaluation and serving load as any other)."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def save_pretrained(self, path: Any) -> None:
        self.model.save_pretrained(path, state_dict=self.state)  # type: ignore[operator]
