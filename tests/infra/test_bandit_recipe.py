"""End-to-end runs of the core demo recipe: learning, exact resume, run-directory safety, CLI."""

import json

import pytest
import torch

from mmrl.bandit.trainer import BanditRecipeConfig, BanditTrainer, main
from mmrl.cli import main as cli_main
from mmrl.config import ConfigError, load_config
from mmrl.run import read_metrics


def cfg_for(tmp_path, name, *overrides):
    return load_config(
        BanditRecipeConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "world.num_prompts=400",
            "allocation.prompts_per_step=16",
            "allocation.rollouts_per_step=128",
            "trainer.eval_every=10",
            *overrides,
        ],
    )


def test_heldout_success_goes_up(tmp_path):
    final = main(cfg_for(tmp_path, "learn", "trainer.steps=40", "allocation.method=knapsack"))
    first = read_metrics(tmp_path / "learn")[0]
    assert first["step"] == 0
    assert final["eval/heldout_success"] > first["eval/heldout_success"] + 0.2


@pytest.mark.parametrize(
    "selection",
    [
        ("allocation.selection=thompson",),
        # a pool of a few dozen training prompts: the walk crosses passes between the checkpoint and the end
        ("allocation.selection=shuffled", "world.num_prompts=60"),
    ],
    ids=["thompson", "shuffled"],
)
def test_resume_reproduces_uninterrupted_run(tmp_path, interrupted_then_resumed, selection):
    args = (
        "trainer.steps=12",
        *selection,
        "allocation.method=knapsack",
        "run.save_every=4",
    )
    straight = main(cfg_for(tmp_path, "straight", *args))

    # Interrupt the second run in its 7th step: the last checkpoint is step 4, steps 5-6 were logged after it.
    resumed = interrupted_then_resumed(
        BanditTrainer,
        main,
        cfg_for(tmp_path, "split", *args),
        cfg_for(tmp_path, "split", *args, "run.resume=true"),
        at=6,
    )

    assert resumed == straight
    strip = lambda rs: [{k: v for k, v in r.items() if k != "time"} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "straight")) == strip(read_metrics(tmp_path / "split"))
    orphaned = (tmp_path / "split/metrics.orphaned.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in orphaned] == [5, 6]  # kept aside, not lost
    sa = torch.load(tmp_path / "straight/checkpoints/step_00000012/state.pt", weights_only=False)
    sb = torch.load(tmp_path / "split/checkpoints/step_00000012/state.pt", weights_only=False)
    assert torch.equal(sa["policy"]["weight"], sb["policy"]["weight"])
    assert sa["prompt_passes"] == sb["prompt_passes"]
    if "shuffled" in selection[0]:
        assert sa["prompt_passes"]["passes"] >= 2


def test_existing_run_directory_is_never_clobbered(tmp_path):
    main(cfg_for(tmp_path, "once", "trainer.steps=2"))
    before = (tmp_path / "once/metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match=r"run\.resume=true"):
        main(cfg_for(tmp_path, "once", "trainer.steps=2"))
    assert (tmp_path / "once/metrics.jsonl").read_text() == before


def test_config_invariant_rejected_at_load():
    with pytest.raises(ConfigError, match="rollouts_per_step"):
        load_config(
            BanditRecipeConfig, None, ["allocation.prompts_per_step=64", "allocation.rollouts_per_step=10"]
        )


def test_cli_train_and_errors(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("recipe: bandit\ntrainer:\n  steps: 3\n")
    rc = cli_main(
        [
            "train",
            str(cfg),
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "world.num_prompts=200",
            "allocation.prompts_per_step=8",
            "allocation.rollouts_per_step=32",
        ]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["step"] == 3
    assert (tmp_path / "run/config.yaml").is_file() and any((tmp_path / "run/tb").iterdir())
    assert cli_main(["train", str(cfg), "trainer.stepz=3"]) == 2
    assert "Did you mean 'steps'" in capsys.readouterr().err
    cfg.write_text("recipe: nope\n")
    assert cli_main(["config", str(cfg)]) == 2
    assert "Available: ['bandit'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    assert "train" in capsys.readouterr().out


def test_every_shipped_config_validates():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs"
    recipes = [p for folder in ("demo", "flow", "vlm") for p in sorted((root / folder).glob("*.yaml"))]
    assert len(recipes) >= 12
    for path in recipes:
        assert cli_main(["config", str(path)]) == 0, path


def test_flow_rewards_used_twice_need_distinct_labels():
    from mmrl.flow.config import FlowGRPOConfig

    twice = "rewards=[{name: shapes}, {name: shapes, options: {strict: true}}]"
    with pytest.raises(ConfigError, match=r"rewards: several rewards log as \['shapes'\]"):
        load_config(FlowGRPOConfig, None, [twice])
    cfg = load_config(FlowGRPOConfig, None, ["rewards=[{name: shapes}, {name: shapes, label: strict}]"])
    assert [spec.key for spec in cfg.rewards] == ["shapes", "strict"]
