"""One rank of ``test_grads.py``: all-reduces hand-made gradients and writes what each parameter holds after."""

import json
import sys

import torch

from mmrl.distributed import all_reduce_grads


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    both, one, neither = (torch.nn.Parameter(torch.ones(n)) for n in (2, 3, 1))
    both.grad = torch.full((2,), float(rank + 1))  # rank 0: 1, rank 1: 2
    if rank == 1:
        one.grad = torch.full((3,), 4.0)
    all_reduce_grads([both, one, neither], 2)
    out = {
        name: None if p.grad is None else p.grad.tolist()
        for name, p in (("both", both), ("one", one), ("neither", neither))
    }
    with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
