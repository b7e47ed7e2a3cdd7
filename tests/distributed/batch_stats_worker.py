"""One rank of ``test_batch_statistics.py``: this rank's half of a batch through the estimators whose statistics
span the batch, reduced over the ranks, and through the flow trainer's advantage step; writes what it got.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/batch_stats_worker.py PREFIX MODEL_DIR
"""

import json
import sys

import torch

from mmrl.config import load_config
from mmrl.core.estimators import RewardBatch, estimate
from mmrl.core.stats import PromptStats
from mmrl.distributed import all_reduce_sum, init_distributed
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer

#: each rank's rewards [4, 2] of two prompts of two samples: rank 0's spread is small, rank 1's large
RAW = [
    torch.tensor([[0.20, 1.0], [0.21, 0.0], [0.22, 1.0], [0.23, 1.0]]),
    torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.1, 1.0], [0.9, 0.0]]),
]
WEIGHTS = torch.tensor([1.0, 0.5])
BASELINE = [torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.5, 0.2, 0.1])]
GROUPS = torch.tensor([0, 0, 1, 1])


def trainer_advantages(rank: int, model_dir: str, estimator: str) -> list[float]:
    """The flow trainer's advantage step (``FlowGRPOTrainer.advantages``) on this rank's rewards: what a data-
    parallel run computes, with the step's other parts (models, rollouts) left out."""
    cfg = load_config(
        FlowGRPOConfig,
        None,
        [f"model.path={model_dir}", "model.device=cpu", f"trainer.advantage={estimator}"],
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.dist = init_distributed()
    trainer.stats = PromptStats()
    trainer.reward_weights = torch.tensor([1.0])
    prompts = [f"rank{rank} prompt{g}" for g in GROUPS.tolist()]
    return trainer.advantages(RAW[rank][:, :1], GROUPS, prompts).adv.tolist()


def main() -> None:
    prefix, model_dir = sys.argv[1:]
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    raw = RAW[rank]
    batch = RewardBatch(raw @ WEIGHTS, GROUPS, raw, WEIGHTS, BASELINE[rank], sum_over_ranks=all_reduce_sum)
    out = {
        "global_std": estimate("global_std", batch).adv.tolist(),
        "gdpo": estimate("gdpo", batch).adv.tolist(),
        "single": estimate("single", batch).adv.tolist(),
        "single_centred": estimate("single", batch, center=True).adv.tolist(),
        "trainer_global_std": trainer_advantages(rank, model_dir, "global_std"),
    }
    with open(f"{prefix}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
