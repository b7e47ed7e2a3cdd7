"""The optimizers a trainer builds from ``trainer.optimizer``, in one place for every front end.

* ``adamw``: ``torch.optim.AdamW``; its states take the trained parameters' dtype (``model.master_weight_dtype``).
* ``adamw8bit``: bitsandbytes' 8-bit AdamW (one byte per state; CUDA).
* ``adamw_kahan``: :class:`KahanAdamW`, AdamW for parameters kept in bfloat16 (``model.master_weight_dtype:
  bfloat16``) whose updates do not round away: pure bfloat16 training in 12 bytes per trained value (weight,
  gradient, momentum and compensation in bfloat16, the second moment in float32) where float32 master weights
  take 16.

Why pure bfloat16 needs it. A bfloat16 weight ``w`` has 8 significant bits, so an update ``u`` with
``|u| < 2^-9 |w|`` leaves ``bf16(w + u) == w``: at a learning rate of 1e-6 AdamW's steps (about ``lr`` each) are
lost on every weight larger than about 5e-4. Kahan summation keeps what the rounding lost in a compensation
buffer ``c`` and adds it back at the next step (Zamirai et al. 2020, "Revisiting BFloat16 Training"; the
``AnyPrecisionAdamW`` of llama-recipes that EasyR1's ``adamw_bf16`` uses)::

    m_t = b1 m + (1 - b1) g                    v_t = b2 v + (1 - b2) g^2
    u   = -lr (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps) - lr wd w       (decoupled weight decay)
    y   = u + c
    w'  = bf16(w + y)
    c'  = y - (w' - w)                          (the part of y the rounding dropped)

so ``w + c`` follows the float32 trajectory to within bfloat16's rounding of ``c`` itself. The update is computed
in float32 from the stored states, and the weight decay goes through the compensation too: llama-recipes
multiplies the bfloat16 weight by ``1 - lr wd`` directly, which rounds away at the learning rates where Kahan
summation matters (``lr wd`` = 1e-8 at EasyR1's 1e-6 and 1e-2).

The second moment is float32 by default: in bfloat16 ``v * 0.999`` rounds back to ``v`` (they differ by 0.1%,
less than half an ulp), so the variance of a bfloat16 state never decays and the steps shrink. On a
least-squares probe over 2,000 steps (``python -m benchmarks.bf16_optimizers``) float32 second moments end 0.66% /
0.04% of the float32 run's move away from it at lr 1e-5 / 1e-4, bfloat16 states 9.8% / 5.4%; EasyR1's
all-bfloat16 states are ``variance_dtype=None`` here (10 bytes per value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

__all__ = ["KahanAdamW", "OptimizerName", "check_optimizer_dtype", "make_optimizer"]

OptimizerName = Literal["adamw", "adamw8bit", "adamw_kahan"]


class KahanAdamW(torch.optim.Optimizer):
    """AdamW with Kahan-compensated updates for low-precision parameters (see the module docstring).

    State per parameter ``p``: ``exp_avg`` and ``compensation`` in ``p.dtype``, ``exp_avg_sq`` in
    ``variance_dtype``, ``step``. A step goes through each parameter (or its shard under FSDP) in chunks of
    ``chunk_size`` values with two float32 scratch buffers of at most that size per device (32 MiB at the
    default), so its temporary memory does not grow with the largest parameter.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate.
        betas: ``(b1, b2)``, the decay rates of the first and second moments.
        eps: added to the second moment's square root.
        weight_decay: decoupled weight decay (AdamW's), applied through the compensation.
        variance_dtype: dtype of the second moment; ``None`` keeps each parameter's dtype (EasyR1's
            ``adamw_bf16``).
        chunk_size: values updated at a time (the results do not depend on it).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        variance_dtype: torch.dtype | None = torch.float32,
        chunk_size: int = 1 << 22,
    ) -> None:
        if (
            lr <= 0
            or eps <= 0
            or weight_decay < 0
            or not all(0 <= beta < 1 for beta in betas)
            or chunk_size < 1
        ):
            raise ValueError(
                f"KahanAdamW: lr and eps must be > 0, weight_decay >= 0, betas in [0, 1) and chunk_size >= 1; got "
                f"lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}, chunk_size={chunk_size}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.variance_dtype = variance_dtype
        self.chunk_size = chunk_size

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict``, which casts every floating state to its parameter's
        dtype, with the second moment kept in ``variance_dtype`` (a float32 variance cast to bfloat16 and back
        would make a resumed run differ from an uninterrupted one)."""
        variances = {
            key: state["exp_avg_sq"] for key, state in state_dict["state"].items() if "exp_avg_sq" in state
        }
        super().load_state_dict(state_dict)
        saved_ids = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for key, param in zip(saved_ids, params, strict=True):
            if key in variances:
                dtype = self.variance_dtype or param.dtype
                self.state[param]["exp_avg_sq"] = variances[key].to(device=param.device, dtype=dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scratch_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # kept for this step
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("KahanAdamW does not take sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.variance_dtype or param.dtype)
                    state["compensation"] = torch.zeros_like(param)
                state["step"] += 1
                step = state["step"].item()
                held = (param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["compensation"])
                # under FSDP these are DTensors: the update is elementwise, so it runs on this rank's shards
                tensors = [_local(tensor) for tensor in held]
                if not all(tensor.is_contiguous() for tensor in tensors):  # strided: the whole tensor at once
                    scratch = [torch.empty_like(tensors[0], dtype=torch.float32) for _ in range(2)]
                    self._update(*tensors, *scratch, group, step)
                    continue
                flat = [tensor.view(-1) for tensor in tensors]
                for start in range(0, tensors[0].numel(), self.chunk_size):
                    chunk = [view[start : start + self.chunk_size] for view in flat]
                    scratch = _scratch(scratch_buffers, tensors[0].device, chunk[0].numel())
                    self._update(*chunk, *scratch, group, step)
        return loss

    def _update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        compensation: torch.Tensor,
        as_float32: torch.Tensor,
        update: torch.Tensor,
        group: dict,
        step: float,
    ) -> None:
        """One AdamW step with Kahan compensation on one chunk of a parameter (the module docstring's formulas).

        Every tensor is brought to float32 in a scratch buffer before it meets a float32 one: mixed-dtype
        in-place ops take an unvectorized casting path on CPUs, about 20x slower (``benchmarks.bf16_optimizers``).
        The values are those of the same ops on mixed dtypes, which compute in float32 too.
        """
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        exp_avg.lerp_(grad.to(exp_avg.dtype), 1 - beta1)
        if exp_avg_sq.dtype == torch.float32:
            grad_float32 = as_float32.copy_(grad)
            exp_avg_sq.mul_(beta2).addcmul_(grad_float32, grad_float32, value=1 - beta2)
        else:
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # y = u + c, with u the AdamW step
        update.copy_(exp_avg_sq).div_(1 - beta2**step).sqrt_().add_(eps).reciprocal_()
        update.mul_(as_float32.copy_(exp_avg)).mul_(-lr / (1 - beta1**step))
        update.add_(as_float32.copy_(compensation))
        weight = as_float32.copy_(param)
        if weight_decay:
            update.add_(weight, alpha=-lr * weight_decay)
        exact = update.add_(weight)  # w + y, exact in float32 to 2^-24 of it
        param.copy_(exact)
        # c' = (w + y) - w': what rounding the sum to the parameter's dtype dropped
        compensation.copy_(exact.sub_(as_float32.copy_(param)))


def _scratch(
    buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]], device: torch.device, size: int
) -> list[torch.Tensor]:
    """Two float32 buffers of ``size`` values on ``device`` from ``buffers`` (a step's), made or grown when a
    larger chunk comes: a fresh allocation per chunk costs page faults on CPUs."""
    if device not in buffers or buffers[device][0].numel() < size:
        buffers[device] = (
            torch.empty(size, dtype=torch.float32, device=device),
            torch.empty(size, dtype=torch.float32, device=device),
        )
    return [buffer[:size] for buffer in buffers[device]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard of a ``DTensor`` held by this rank (a view of its storage), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def make_optimizer(
    params: list[torch.nn.Parameter], name: str, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """The optimizer ``trainer.optimizer`` names over ``params`` (see the module docstring).

    Raises:
        ValueError: an unknown name.
        ImportError: ``adamw8bit`` without bitsandbytes installed.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_kahan":
        return KahanAdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise ImportError(
                "trainer.optimizer=adamw8bit needs bitsandbytes (pip install bitsandbytes)"
            ) from err
        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"trainer.optimizer={name!r}: choose adamw, adamw8bit or adamw_kahan")


def check_optimizer_dtype(name: str, master_weight_dtype: str) -> None:
    """Refuse ``adamw_kahan`` on float32 trained parameters, whose updates do not round away (the compensation
    buffer would be 4 bytes per value for nothing).

    Raises:
        ValueError: naming both keys.
    """
    if name == "adamw_kahan" and master_weight_dtype == "float32":
        raise ValueError(
            "trainer.optimizer=adamw_kahan compensates the rounding of bfloat16/float16 trained parameters, but "
            "model.master_weight_dtype is float32: set model.master_weight_dtype=bfloat16 (pure bfloat16 "
            "training) or trainer.optimizer=adamw"
        )
