"""Data-parallel training across processes: joining the launch, averaging gradients, FSDP2 sharding.

``accelerate launch`` (or ``torchrun``) starts one process per GPU with ``RANK`` / ``WORLD_SIZE`` in the
environment; :func:`init_distributed` joins the process group (NCCL on GPUs, gloo on CPUs).
Every rank rolls out its own prompts and the ranks average their gradients, so one step trains on
``world_size`` times the rollouts.

Two ways to hold the model, picked by the accelerate config the run was launched with:

* **DDP** (``configs/accelerate/ddp.yaml``): every rank keeps the whole model; :func:`all_reduce_grads`
  averages the trainable gradients in one collective before each optimizer step. With LoRA on a frozen base
  this is all a run needs: the trainable state is small.
* **FSDP2** (``configs/accelerate/fsdp.yaml``, accelerate sets ``ACCELERATE_USE_FSDP=true``): parameters,
  gradients and optimizer state are sharded over the ranks by torch's ``fully_shard``, one unit per block the
  model lists in ``_no_split_modules``, one per submodule a trainer calls directly, then the root
  (:func:`shard_model`), for full fine-tuning of models whose replicas do not fit. The shards' gradients are
  reduced by FSDP itself. Every forward of a sharded model is a collective (it all-gathers the block's
  parameters), so all ranks must run the same sequence of forwards: trainers keep their number of forward and
  optimizer calls per step equal across ranks (:meth:`DistState.max_over_ranks`).

A rank ends with :func:`end_launched_process` (``mmrl``'s command line calls it), not the interpreter's teardown.

Collectives that every rank must enter together: :meth:`DistState.barrier`, :meth:`DistState.max_over_ranks`,
:meth:`DistState.sum_over_ranks`, :func:`all_reduce_sum`, :func:`all_reduce_grads`, :func:`full_state_dict` and
``mmrl.checkpoint.load_trainable`` on a sharded model.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = [
    "DistState",
    "all_reduce_grads",
    "all_reduce_sum",
    "broadcast_params",
    "end_launched_process",
    "full_state_dict",
    "full_tensor",
    "init_distributed",
    "is_launched_rank",
    "is_sharded",
    "load_optimizer_state",
    "optimizer_state",
    "shard_like",
    "shard_model",
    "shutdown_distributed",
]


@dataclass(frozen=True)
class DistState:
    """Where this process stands in a data-parallel launch.

    Attributes:
        rank: this process's index, 0 .. world_size - 1.
        world_size: number of training processes (1 without a launcher).
        fsdp: whether the launch asked for FSDP sharding (``ACCELERATE_USE_FSDP=true``).
        reshard_after_forward: FSDP's ``fsdp_reshard_after_forward`` (free the gathered parameters after each
            forward: less memory, one more all-gather in backward).
    """

    rank: int = 0
    world_size: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = True

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run directory."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.active:
            torch.distributed.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def own(self, per_rank: list[Any] | None, fallback: Any) -> Any:
        """This rank's entry of a list :meth:`gather` made, when it was made by as many ranks as run now; else
        ``fallback`` (a run resumed on another number of ranks: the caller reseeds what must differ per rank)."""
        return per_rank[self.rank] if per_rank is not None and len(per_rank) == self.world_size else fallback

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` any rank holds: how many collective calls (forwards, optimizer steps) every rank
        makes so that none waits for a call the others never make."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.long, device=_collective_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed element by element over the ranks (each passes as many): a step's counts over the
        whole launch, e.g. the completion tokens its loss is normalised by (float64: counts stay exact)."""
        if not self.active:
            return values
        return all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()


#: non-empty while this process is in the process group :func:`init_distributed` made
_JOINED: list[bool] = []


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def init_distributed() -> DistState:
    """Join the launch's process group, if there is one (``WORLD_SIZE > 1``), and read the FSDP settings.

    Idempotent: a second call returns the same state. Without a launcher this is ``DistState()``.
    """
    fsdp = _env_true("ACCELERATE_USE_FSDP")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower() not in ("false", "0", "no")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return DistState(dist.get_rank(), dist.get_world_size(), fsdp, reshard)
    if not is_launched_rank():
        return DistState(fsdp=False)
    # the launcher set RANK, WORLD_SIZE, MASTER_ADDR/PORT and LOCAL_RANK: NCCL across GPUs, gloo on CPUs
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    _JOINED.append(True)
    return DistState(dist.get_rank(), dist.get_world_size(), fsdp, reshard)


def shutdown_distributed() -> None:
    """Leave the process group :func:`init_distributed` joined (a group the caller made is left alone), as
    PyTorch asks before a process exits."""
    if _JOINED and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _JOINED.clear()


def is_launched_rank() -> bool:
    """Whether a multi-process launcher (``accelerate launch``, ``torchrun``) started this process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def end_launched_process(status: int) -> NoReturn:
    """End a rank of a multi-process launch with exit status ``status``, skipping the interpreter's teardown.

    Why: the process group's worker threads outlive :func:`shutdown_distributed` (DDP and FSDP keep the group
    referenced from C++, so ``destroy_process_group`` does not join them). A worker thread that frees a finished
    collective's tensors takes the GIL; if the interpreter is finalizing by then, Python ends that thread inside
    a C++ destructor and the process aborts ("terminate called without an active exception", SIGABRT) after a
    finished run: about one in 25 two-process gloo runs here (traced with gdb to the gloo run loop freeing an
    all-gather; pytorch/pytorch#190489). Ending with ``os._exit`` leaves no teardown for that race. The run's
    files are written and closed before this is called; it flushes logging and the output streams first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _collective_device() -> torch.device:
    """The device collectives run on: the current GPU under NCCL, the CPU under gloo."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank (a collective every rank enters with the same shape and dtype), on ``t``'s
    device; ``t`` itself is left as it is. The advantage estimators' batch statistics reduce through it
    (``mmrl.core.estimators.RewardBatch.sum_over_ranks``), and :meth:`DistState.sum_over_ranks`."""
    buffer = t.detach().to(_collective_device(), copy=True)
    torch.distributed.all_reduce(buffer)
    return buffer.to(t.device)


def all_reduce_grads(params: list[nn.Parameter], world_size: int) -> None:
    """Average the gradients of ``params`` over the ranks, in one flat all-reduce.

    The average of per-rank gradients is one update's over all ranks' samples only when each rank's loss is
    normalised by the launch's count (tokens, rows) times ``world_size``, not by its own: a trainer all-reduces
    its counts first (:meth:`DistState.sum_over_ranks`, the VLM trainer's ``update``).

    A parameter without a gradient on this rank (it took no part in this rank's loss) contributes zeros, so
    every rank reduces the same buffer whatever its batch held. A parameter no rank has a gradient for keeps
    ``grad = None``, as in a single process (and torch DDP): the optimizer then skips it, where a zero gradient
    would still move it by AdamW's momentum and weight decay (Wan2.2's expert that none of a step's timesteps
    reached).
    """
    if world_size <= 1 or not params:
        return
    device = _collective_device()
    has_grad = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.float32
    )  # [P] 1 where this rank has one
    flat = torch.cat(
        [
            *(
                (p.grad if p.grad is not None else torch.zeros_like(p))
                .detach()
                .reshape(-1)
                .to(device, torch.float32)
                for p in params
            ),
            has_grad.to(device),
        ]
    )
    torch.distributed.all_reduce(flat)
    ranks_with_grad = flat[-len(params) :].cpu()  # [P] how many ranks had a gradient
    flat /= world_size
    offset = 0
    for p, ranks in zip(params, ranks_with_grad.tolist(), strict=True):
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype) if ranks > 0 else None
        offset += n


def broadcast_params(params: list[nn.Parameter], world_size: int) -> None:
    """Give every rank rank 0's values of ``params`` (as DDP does when it wraps a model): a LoRA's random
    initialisation draws from each rank's own seed, and ranks that start apart stay apart."""
    if world_size <= 1:
        return
    device = _collective_device()
    with torch.no_grad():
        for p in params:
            buffer = p.detach().to(device)
            torch.distributed.broadcast(buffer, src=0)
            p.copy_(buffer.to(p.device))


def shard_model(
    model: nn.Module,
    reshard_after_forward: bool = True,
    extra: Sequence[nn.Module | list[nn.Module]] = (),
    methods: Sequence[str] = (),
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """FSDP2: shard ``model`` in place over the process group, one unit per block class named in the model's
    ``_no_split_modules`` (diffusers and transformers list their transformer blocks there), then one unit per
    module of ``extra``, then the root. With ``param_dtype`` the gathered parameters are cast to it for the
    forward and backward (float32 master weights of a bfloat16 model gathered in bfloat16: half the traffic),
    and gradients are reduced in float32 (FSDP2's ``MixedPrecisionPolicy``); the shards keep their dtype.

    A unit's parameters are gathered only while a module of that unit is called, so a caller that runs
    submodules of ``model`` directly (the VLM's scoring runs the backbone, then the LM head chunk by chunk) names
    each of them in ``extra``: called outside the root's forward, the root's parameters would still be shards.
    An ``extra`` entry that is a list of modules becomes one grouped unit (modules that share a parameter, e.g.
    tied input and output embeddings); list inner modules before the modules that hold them. ``methods`` names
    methods of the root that run its submodules besides ``forward`` (transformers' ``generate``): they are
    wrapped in the root's forward hooks, so they see its parameters gathered, and a call of one counts as the
    root's forward (FSDP requires the root to run before any other unit).

    The module keeps its class's methods and attributes (FSDP2 swaps in a subclass), so adapters and trainers
    call it as before. Build the optimizer after this call: sharding replaces the parameters by ``DTensor`` shards.

    Raises:
        ValueError: the model names no block classes to shard by.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} lists no block classes in _no_split_modules, so FSDP has nothing to wrap "
            "by; launch with configs/accelerate/ddp.yaml instead"
        )
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    for unit in [*blocks, *extra]:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    for name in methods:
        register_fsdp_forward_method(model, name)
    return model


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by :func:`shard_model` (FSDP manages it; with ``reshard_after_forward=False``
    its parameters are whole tensors from a forward until the next backward, so this does not ask them)."""
    return bool(_fsdp_modules(model))


def _reshard(model: nn.Module) -> None:
    """Put the shards back in place of parameters a forward left gathered (``reshard_after_forward=False``), so
    that the model's parameters are the ones the optimizer holds."""
    for module in _fsdp_modules(model):
        module.reshard()


def full_state_dict(model: nn.Module, trainable_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's parameters as whole CPU tensors, gathered from the shards on every rank (a collective on a
    sharded model), ``trainable_only``: those with ``requires_grad``."""
    _reshard(model)
    return {
        name: full_tensor(p.detach()).cpu().clone()
        for name, p in model.named_parameters()
        if p.requires_grad or not trainable_only
    }


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from an FSDP shard (a collective), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) laid out as ``like``: this rank's shard when ``like`` is an FSDP shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(value.to(like.device, like.dtype), like.device_mesh, like.placements)
    return value


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state for a checkpoint: whole tensors keyed by parameter name for a sharded model (a
    collective), else ``optimizer.state_dict()``."""
    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    _reshard(model)  # the parameters are named by the model: they must be the shards the optimizer holds

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Inverse of :func:`optimizer_state` (every rank loads the whole state and keeps its shard)."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    _reshard(model)

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
