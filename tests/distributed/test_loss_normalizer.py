"""The VLM trainer's loss normaliser under DDP on two CPU processes (gloo): the ranks' averaged gradient equals one
process's on the rows both kept, whatever each rank's token and row counts (TRL's ``dapo``, verl's token-mean with
the global batch), and a rank that kept no rows leaves the other's gradient as one process computes it."""

import torch

from tests.distributed.two_ranks import needs_gloo, run_two_ranks

pytestmark = needs_gloo


def test_ddp_gradient_is_the_gradient_of_the_concatenated_batch(tmp_path):
    prefix = tmp_path / "normalizer"
    args = [
        str(prefix),
        "model.path=checkpoints/shapes_vlm",
        "model.device=cpu",
        f"run.output_dir={tmp_path}",
        "run.name=normalizer",
        "run.progress=false",
        "run.tensorboard=false",
        "data.image_size=64",
        "data.train_limit=32",
        "data.eval_limit=4",
        "generation.max_new_tokens=6",
        "trainer.mode=group",
        "trainer.num_generations=3",
        "allocation.prompts_per_step=4",
        "trainer.minibatch_size=4",
        "trainer.beta=0",
        "rewards=[{name: exact_match}]",
    ]
    run_two_ranks("loss_normalizer_worker.py", *args, timeout=600)
    results = torch.load(f"{prefix}.rank0.pt", weights_only=False)
    assert set(results) == {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"}
    for loss_agg, cases in results.items():
        for case, (ddp, single) in cases.items():
            assert float(single.norm()) > 1e-2, (loss_agg, case)  # a real gradient, far above the tolerances
            # with each rank's own normaliser: |ddp - single| / |single| = 0.4 to 0.48 for the unequal ranks, and
            # |ddp| / |single| = 0.5 with a rank that kept nothing
            relative = float((ddp - single).norm() / single.norm())
            assert relative < 1e-5, (loss_agg, case, relative)
            torch.testing.assert_close(ddp, single, rtol=1e-5, atol=1e-7, msg=f"{loss_agg} {case}")
