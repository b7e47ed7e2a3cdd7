"""``python -m benchmarks.flow_grpo``: the forwards of the modules the trainer swaps in for the policy (the
guidance-distillation teacher here) are timed as forwards, not left in the trainer's overhead."""

from __future__ import annotations

from pathlib import Path

from benchmarks import flow_grpo

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "allocation.prompts_per_step=2",
    "allocation.rollouts_per_step=8",
    "allocation.n_min=4",
    "trainer.minibatch_size=8",
    "trainer.eval_prompts=2",
    "trainer.eval_every=1",
    "run.save_every=0",
]


def test_the_distillation_teachers_forwards_count_as_forwards(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)

    def run(weight: float) -> dict:
        argv = ["--config", "configs/demo/flow_shapes_distill.yaml", "--steps", "1", *TINY]
        argv += [f"run.output_dir={tmp_path / str(weight)}", f"trainer.guidance_distill.weight={weight}"]
        return flow_grpo.main(argv)

    without, with_teacher = run(0.0), run(1.0)
    # AWM at two regression points: the teacher adds one forward at each (its conditional and unconditional
    # halves in one batch); before the swapped-in modules were hooked, the two runs counted the same forwards
    regression_points = 2
    assert with_teacher["forward_calls"] == without["forward_calls"] + regression_points
    assert 0.0 < with_teacher["overhead_frac"] < 1.0
