"""Global seeding and RNG state capture, so a resumed run draws exactly what the uninterrupted one would."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

__all__ = ["EVAL_SEED", "get_rng_state", "request_seed", "seed_everything", "set_rng_state"]

#: the seed of every evaluation's noise and sampling, the same at each one (scores are comparable across steps)
#: and never drawn from a training generator (how often a run evaluates leaves its training draws as they were)
EVAL_SEED = 1234


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch (all devices); return a CPU ``torch.Generator`` seeded with ``seed``.

    Recipes draw their own randomness from the returned generator where an API accepts one, which keeps
    draws independent of library code that touches the global RNG.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def get_rng_state(generators: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Every RNG state of the process (and of named generators), for a checkpoint."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["generators"] = {name: g.get_state() for name, g in (generators or {}).items()}
    return state


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore what :func:`get_rng_state` captured."""
    random.setstate(state["python"])
    _set_numpy_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in (generators or {}).items():
        if name not in state["generators"]:
            raise KeyError(f"checkpoint has no RNG state for generator {name!r}")
        g.set_state(state["generators"][name])


def _numpy_state() -> dict[str, Any]:
    """numpy's global RNG state in types a ``weights_only`` torch.load reads (a tensor, not an ndarray)."""
    bit_generator, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "bit_generator": bit_generator,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _set_numpy_state(state: dict[str, Any]) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (state["bit_generator"], keys, state["position"], state["has_gauss"], state["cached_gaussian"])
    )


def request_seed(run_seed: int, rank: int, step: int, index: int) -> int:
    """Seed of rollout request ``index`` of training step ``step`` on data-parallel rank ``rank``: a hash, so that
    nearby steps get unrelated samples and a seed does not depend on which requests were made before."""
    digest = hashlib.blake2b(f"{run_seed}/{rank}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63
