"""Flow objectives: how one rollout step's samples update the weights (``trainer.objective``).

One file per objective, each registered by name (:mod:`mmrl.flow.objectives.registry`): ``grpo`` (Flow-GRPO's
clipped ratio on the SDE transitions), ``nft`` (DiffusionNFT), ``awm`` (Advantage Weighted Matching) and ``rwr``
(reward-weighted flow matching on the preferred samples). The last three regress velocities at re-noised points
of the final samples through the trainer's :meth:`~mmrl.flow.trainer.FlowGRPOTrainer.regress`, which adds the
reference KL, the guidance distillation and the optimizer steps for all of them.
"""

from mmrl.flow.objectives.registry import (
    FlowObjective,
    check_objective,
    get_objective,
    list_objectives,
    register_objective,
)

__all__ = ["FlowObjective", "check_objective", "get_objective", "list_objectives", "register_objective"]
