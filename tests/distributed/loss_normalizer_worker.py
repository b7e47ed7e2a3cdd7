"""One rank of ``test_loss_normalizer.py``, started under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/loss_normalizer_worker.py PREFIX

Both ranks hold rank 0's batch of 12 completions of 1 to 6 tokens. Per ``trainer.loss_agg`` and case, each rank
runs the VLM trainer's ``update`` on its own kept rows and the ranks average their gradients (DDP's
``all_reduce_grads``); rank 0 then runs ``update`` as one process on the rows both ranks kept. No optimizer step is
taken, so every update starts from the same weights. Rank 0 writes ``{loss_agg: {case: (ddp, single)}}``, each a
flat gradient, to ``PREFIX.rank0.pt``.
"""

import dataclasses
import sys

import torch

from mmrl.config import load_config
from mmrl.distributed import DistState, all_reduce_grads, end_launched_process
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.trainer import VLMRLVRTrainer

#: completion length of each of the 12 rows: rank 0's rows are short, rank 1's long, so the ranks' own token
#: (and row) counts differ
LENGTHS = [1, 1, 2, 6, 3, 6, 4, 6, 5, 6, 6, 2]
#: per case, the rows each rank keeps (a rank whose dynamic sampling kept no group keeps none)
CASES = {
    "unequal": ([0, 1], list(range(2, 12))),
    "rank0_kept_none": ([], list(range(2, 12))),
}


def with_length(sample, length: int):
    """``sample`` with its completion's tokens (and behaviour log-probs) repeated or cut to ``length``."""
    positions = [i % len(sample.completion_token_ids) for i in range(length)]
    return dataclasses.replace(
        sample,
        completion_token_ids=[sample.completion_token_ids[i] for i in positions],
        logprobs=sample.logprobs[positions],
    )


def main() -> None:
    prefix, *overrides = sys.argv[1:]
    torch.set_num_threads(1)
    trainer = VLMRLVRTrainer(load_config(VLMRLVRConfig, None, overrides), None)
    trainer.setup()  # (rank 0's LoRA initialisation on both ranks)
    launched = trainer.dist
    pairs, *_ = trainer.collect()
    shared = [pairs]
    torch.distributed.broadcast_object_list(shared, src=0)
    pairs = [
        (example, with_length(sample, n)) for (example, sample), n in zip(shared[0], LENGTHS, strict=True)
    ]
    adv = torch.randn(len(pairs), generator=torch.Generator().manual_seed(0))
    grads: list[torch.Tensor] = []

    def record(optimizer, params, max_grad_norm, lr=None):
        all_reduce_grads(list(params), trainer.dist.world_size)
        grads.append(
            torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        )
        optimizer.zero_grad(set_to_none=True)

    trainer.optimizer_step = record
    results: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for loss_agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        trainer.cfg.trainer.loss_agg = loss_agg
        results[loss_agg] = {}
        for case, rows_per_rank in CASES.items():
            keep = torch.zeros(len(pairs), dtype=torch.bool)
            keep[rows_per_rank[launched.rank]] = True
            trainer.dist = launched
            trainer.update(pairs, adv, keep)
            ddp = grads.pop()
            if launched.is_main:
                keep[[row for rows in rows_per_rank for row in rows]] = True
                trainer.dist = DistState()  # one process: no collective, its own counts
                trainer.update(pairs, adv, keep)
                results[loss_agg][case] = ddp, grads.pop()
    if launched.is_main:
        torch.save(results, f"{prefix}.rank0.pt")
    launched.barrier()
    end_launched_process(0)


if __name__ == "__main__":
    main()
