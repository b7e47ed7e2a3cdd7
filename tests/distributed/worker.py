"""One rank of a data-parallel training run, started by ``test_data_parallel.py`` under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/worker.py RECIPE PREFIX key=value ...

Trains the recipe through ``run_recipe`` (what ``mmrl train`` runs), then saves this rank's initial and final
trainable weights (whole tensors, gathered from the shards under FSDP), whether the model was sharded, and the
final metrics to ``PREFIX.rank{R}.pt``, and ends as ``mmrl train`` ends a launched rank.
"""

import importlib
import sys

import torch

from mmrl.config import load_config
from mmrl.distributed import end_launched_process, full_state_dict, is_sharded
from mmrl.loop import run_recipe
from mmrl.recipes import get_recipe

TRAINERS = {"flow_grpo": "FlowGRPOTrainer", "vlm_rlvr": "VLMRLVRTrainer"}


def main() -> None:
    name, prefix, *overrides = sys.argv[1:]
    recipe = get_recipe(name)
    base = getattr(importlib.import_module(recipe.module), TRAINERS[name])

    class Recording(base):
        def trained_module(self):
            return self.adapter.transformer if name == "flow_grpo" else self.model

        def setup(self):
            super().setup()
            self.initial_weights = full_state_dict(self.trained_module())

        def train(self):
            self.final_metrics = super().train()
            return self.final_metrics

        def cleanup(self):
            model = self.trained_module()
            record = {
                "initial": self.initial_weights,
                "weights": full_state_dict(model),  # a collective under FSDP: every rank gathers
                "sharded": is_sharded(model),
                "metrics": self.final_metrics,
            }
            torch.save(record, f"{prefix}.rank{self.dist.rank}.pt")
            super().cleanup()

    run_recipe(load_config(recipe.load_config_class(), None, overrides), Recording)
    end_launched_process(0)  # as `mmrl train` ends a rank


if __name__ == "__main__":
    main()
