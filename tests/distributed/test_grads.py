"""``all_reduce_grads`` on two CPU processes (gloo): gradients averaged over the ranks, a rank without one counting
zero, and a parameter no rank has a gradient for left without one, as in a single process."""

import json
from pathlib import Path

from tests.distributed.two_ranks import needs_gloo, run_two_ranks

pytestmark = needs_gloo


def test_gradients_average_over_ranks_and_one_no_rank_has_stays_none(tmp_path):
    prefix = tmp_path / "grads"
    args = [str(prefix)]
    run_two_ranks("grads_worker.py", *args)
    for rank in (0, 1):
        grads = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
        # (1 + 2) / 2; (0 + 4) / 2 (rank 0 had none: a zero); none on either rank: no gradient, so AdamW skips it
        assert grads == {"both": [1.5, 1.5], "one": [2.0, 2.0, 2.0], "neither": None}
