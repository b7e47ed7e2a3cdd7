"""Registry of flow objectives: one name -> one update, read by the flow trainer and its config.

Every objective has the same signature ``update(trainer, batch) -> None``: it receives the trainer (its model
adapter, generator, minibatches, regression path, optimizer steps and metrics) and one rollout step's
:class:`~mmrl.flow.batch.StepBatch`, and takes that batch's optimizer steps. The registry is the only routing:
the trainer never branches on an objective's name, and what the rest of a step needs to know about the objective
is a flag of its registration (:class:`FlowObjective`).

Adding one: a module ``mmrl/flow/objectives/<name>.py`` with ::

    @register_objective("my_objective", "one line for config help", trains_on="final_samples")
    def my_update(trainer: FlowGRPOTrainer, batch: StepBatch) -> None:
        rows, sigma, x_t, target = trainer.regression_points(batch.final_latents, batch.groups)
        ...
        trainer.regress(x_t, sigma, batch.cond.select(rows), loss_fn)

(``check_config=fn`` adds the objective's own config checks), listed in ``_PROVIDERS`` below (or imported before the config is loaded); configs name it in
``trainer.objective``, and it works with every model family and rollout mode (flat, branch, explore, pool).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mmrl.flow.batch import StepBatch
    from mmrl.flow.config import FlowGRPOConfig
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = ["FlowObjective", "check_objective", "get_objective", "list_objectives", "register_objective"]

Update = Callable[["FlowGRPOTrainer", "StepBatch"], None]
CheckConfig = Callable[["FlowGRPOConfig"], None]
TrainsOn = Literal["transitions", "final_samples"]


@dataclass(frozen=True)
class FlowObjective:
    """A registered objective and what the rest of the training step needs to know about it.

    Attributes:
        name: the registry key (``trainer.objective``).
        update: ``update(trainer, batch)``, the step's optimizer steps.
        description: one line for config help and error messages.
        trains_on: ``"transitions"``: the SDE transitions' log-probs (Flow-GRPO): flat rollouts sample the SDE
            window, pooled samples get staleness weights per transition. ``"final_samples"``: velocities regressed
            at re-noised points of the clean final samples (DiffusionNFT, AWM, RWR): flat rollouts sample the ODE
            (SDE noise left in a sample would be learned back), and guidance distillation can be added.
        same_count_per_rank: False when the objective trains a data-dependent subset of the batch (RWR: the
            preferred samples only), so data-parallel ranks may hold different numbers of points, which an FSDP
            launch cannot pair up.
        check_config: ``check_config(cfg)``, the objective's own checks of a whole config (its settings section
            against the sampler, say), run by the config's validator when ``trainer.objective`` names it; raises
            ``ValueError`` naming the key. None: nothing beyond the shared checks.
    """

    name: str
    update: Update
    description: str
    trains_on: TrainsOn
    same_count_per_rank: bool = True
    check_config: CheckConfig | None = None


_OBJECTIVES: dict[str, FlowObjective] = {}

# Modules whose import registers their objectives, imported on first lookup (as the model-family registries do).
_PROVIDERS: tuple[str, ...] = (
    "mmrl.flow.objectives.grpo",
    "mmrl.flow.objectives.nft",
    "mmrl.flow.objectives.awm",
    "mmrl.flow.objectives.rwr",
)


def register_objective(
    name: str,
    description: str,
    *,
    trains_on: TrainsOn,
    same_count_per_rank: bool = True,
    check_config: CheckConfig | None = None,
) -> Callable[[Update], Update]:
    """Function decorator adding an objective to the registry under ``name`` (see :class:`FlowObjective`).

    Raises:
        ValueError: ``name`` is already registered to another function.
    """

    def wrap(update: Update) -> Update:
        if name in _OBJECTIVES and _OBJECTIVES[name].update is not update:
            raise ValueError(f"flow objective {name!r} is already registered")
        _OBJECTIVES[name] = FlowObjective(
            name, update, description, trains_on, same_count_per_rank, check_config
        )
        return update

    return wrap


def _load_providers() -> None:
    for module in _PROVIDERS:
        importlib.import_module(module)


def list_objectives(trains_on: TrainsOn | None = None) -> list[str]:
    """Names of the registered objectives, sorted; only those training on ``trains_on`` when given."""
    _load_providers()
    return sorted(name for name, objective in _OBJECTIVES.items() if trains_on in (None, objective.trains_on))


def get_objective(name: str) -> FlowObjective:
    """The objective registered as ``name``.

    Raises:
        KeyError: unknown name, listing the registered ones.
    """
    _load_providers()
    if name not in _OBJECTIVES:
        raise KeyError(f"unknown flow objective {name!r}. Available: {list_objectives()}")
    return _OBJECTIVES[name]


def check_objective(name: str, where: str = "trainer.objective") -> FlowObjective:
    """Config-time check that ``name`` is registered.

    Raises:
        ValueError: naming ``where`` and the registered names.
    """
    try:
        return get_objective(name)
    except KeyError:
        raise ValueError(
            f"{where}: unknown flow objective {name!r}; registered: {list_objectives()}"
        ) from None
