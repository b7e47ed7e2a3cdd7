"""End-to-end runs of the core demo recipe: learning, exact resume, run-directory safety, CLI."""

import json

import pytest
import torch

import rewards
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


def test_every_evaluation_is_written_whatever_log_every(tmp_path):
    main(cfg_for(tmp_path, "sparse", "trainer.steps=8", "trainer.eval_every=3", "run.log_every=2"))
    records = read_metrics(tmp_path / "sparse")
    assert [r["step"] for r in records] == [
        0,
        2,
        3,
        4,
        6,
        8,
    ]  # log_every's steps, and the evaluations' 3 and 6
    assert [r["step"] for r in records if "eval/heldout_success" in r] == [0, 3, 6, 8]


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

    twice = "rewards=[{name: shapes}, {name: shapes, options: {partial: true}}]"
    with pytest.raises(ConfigError, match=r"rewards: several rewards log as \['shapes'\]"):
        load_config(FlowGRPOConfig, None, [twice])
    cfg = load_config(FlowGRPOConfig, None, ["rewards=[{name: shapes}, {name: shapes, label: strict}]"])
    assert [spec.key for spec in cfg.rewards] == ["shapes", "strict"]


@pytest.mark.parametrize(
    "schema, override, message",
    [
        (
            "mmrl.vlm.config:VLMRLVRConfig",
            "rewards=[{name: exact_matc}]",
            f"rewards.0: unknown reward name 'exact_matc'; registered: {rewards.list_rewards()}",
        ),
        (
            "mmrl.vlm.config:VLMRLVRConfig",
            "eval_rewards=[{name: numeric, options: {rel_tol: 0.1, tolerance: 1}}]",
            "eval_rewards.0: options ['tolerance'] are not options of the 'numeric' reward (it takes ['rel_tol', "
            "'abs_tol', 'answer_tag', 'require_answer_tag', 'number_words'])",
        ),
        (
            "mmrl.flow.config:FlowGRPOConfig",
            "rewards=[{name: shapes}, {name: remote}]",
            "rewards.1: the 'remote' reward needs the options ['url']",
        ),
    ],
)
def test_reward_names_and_options_are_checked_when_the_config_loads(schema, override, message):
    module, name = schema.split(":")
    with pytest.raises(ConfigError) as error:
        load_config(getattr(__import__(module, fromlist=[name]), name), None, [override])
    assert str(error.value) == f"invalid config:\n  {message}"


def test_a_reward_taking_any_options_accepts_them_and_the_cli_names_a_bad_one(tmp_path, capsys):
    from mmrl.flow.config import FlowGRPOConfig

    judge = (
        "rewards=[{name: vlm_judge, options: {mode: yes_prob, model_id: some/vlm}}]"  # **options: the VLM's
    )
    assert load_config(FlowGRPOConfig, None, [judge]).rewards[0].options["model_id"] == "some/vlm"
    path = tmp_path / "vlm.yaml"
    path.write_text("recipe: vlm_rlvr\nrewards:\n  - name: exact_match\n    options: {numbr_words: true}\n")
    assert cli_main(["config", str(path)]) == 2
    assert capsys.readouterr().err.endswith(
        "mmrl: error: invalid config:\n  rewards.0: options ['numbr_words'] are not options of the 'exact_match' "
        "reward (it takes ['answer_tag', 'require_answer_tag', 'number_words'])\n"
    )
