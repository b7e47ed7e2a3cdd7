"""The run directory across failures: resume with or without a checkpoint, cut metric lines, setup leftovers,
non-finite metrics (the core demo recipe, which runs in seconds)."""

from __future__ import annotations

import json
import logging

import pytest

from mmrl.bandit.trainer import BanditRecipeConfig, BanditTrainer, main
from mmrl.config import ConfigError, load_config, load_yaml
from mmrl.run import Run, read_metrics, run_config_file


def cfg_for(tmp_path, name, *overrides):
    return load_config(
        BanditRecipeConfig,
        None,
        [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "world.num_prompts=200",
            "allocation.prompts_per_step=8",
            "allocation.rollouts_per_step=32",
            "trainer.eval_every=3",
            "trainer.steps=8",
            *overrides,
        ],
    )


def strip(records):
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


@pytest.fixture
def straight(tmp_path):
    final = main(cfg_for(tmp_path, "straight"))
    return final, strip(read_metrics(tmp_path / "straight"))


def test_resume_before_the_first_checkpoint_is_exact(tmp_path, straight, interrupted_then_resumed) -> None:
    # no checkpoint until the end: a run stopped in step 6 restarts at 0, and steps 0-5 are logged once
    resumed = interrupted_then_resumed(
        BanditTrainer, main, cfg_for(tmp_path, "split"), cfg_for(tmp_path, "split", "run.resume=true"), at=5
    )
    assert resumed == straight[0]
    records = strip(read_metrics(tmp_path / "split"))
    assert records == straight[1] and [r["step"] for r in records] == list(range(9))
    orphaned = (tmp_path / "split/metrics.orphaned.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in orphaned] == [0, 1, 2, 3, 4, 5]  # kept aside, not lost


def test_resume_after_a_crash_during_the_first_save_is_exact(tmp_path, straight, monkeypatch) -> None:
    original = BanditTrainer.save_checkpoint

    def crash(self):
        raise KeyboardInterrupt  # killed while writing the first checkpoint (step 4)

    monkeypatch.setattr(BanditTrainer, "save_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        main(cfg_for(tmp_path, "split", "run.save_every=4"))
    monkeypatch.setattr(BanditTrainer, "save_checkpoint", original)
    resumed = main(cfg_for(tmp_path, "split", "run.save_every=4", "run.resume=true"))
    assert resumed == straight[0]
    assert [r["step"] for r in read_metrics(tmp_path / "split")] == list(range(9))


def test_a_cut_last_metrics_line_is_named_and_moved_aside(tmp_path, straight, monkeypatch) -> None:
    original = BanditTrainer.train_step

    def crash(self):
        if self.step == 5:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(BanditTrainer, "train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        main(cfg_for(tmp_path, "cut", "run.save_every=3"))
    monkeypatch.setattr(BanditTrainer, "train_step", original)
    metrics = tmp_path / "cut/metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines) + '\n{"step": 6, "rew')  # killed while writing the line of step 6
    resumed = main(cfg_for(tmp_path, "cut", "run.save_every=3", "run.resume=true"))
    log = (tmp_path / "cut/log.txt").read_text()
    assert f"WARNING mmrl.run: {metrics} line {len(lines) + 1} is not valid JSON" in log
    assert resumed == straight[0]
    assert strip(read_metrics(tmp_path / "cut")) == straight[1]
    assert '{"step": 6, "rew' in (tmp_path / "cut/metrics.orphaned.jsonl").read_text()


def test_a_corrupt_metrics_line_is_named_with_file_and_line(tmp_path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    (run_dir / "config.yaml").write_text("recipe: bandit\n")
    (run_dir / "command.txt").write_text("mmrl train c.yaml\n")
    with pytest.raises(ValueError, match=r"r/metrics\.jsonl line 2 is not valid JSON"):
        read_metrics(run_dir)
    cfg = cfg_for(tmp_path, "r", "run.resume=true")
    with pytest.raises(ValueError, match=r"r/metrics\.jsonl line 2 is not valid JSON"):
        Run(cfg.run, cfg)  # (resume without a checkpoint moves every line aside: it reads them first)


def test_a_run_that_failed_in_setup_does_not_block_the_rerun(tmp_path, monkeypatch, capsys) -> None:
    def broken(self):
        raise ValueError("setup failed")

    original = BanditTrainer.setup
    monkeypatch.setattr(BanditTrainer, "setup", broken)
    with pytest.raises(ValueError, match="setup failed"):
        main(cfg_for(tmp_path, "again", "run.tensorboard=true"))
    assert {p.name for p in (tmp_path / "again").iterdir()} == {
        "command.txt",
        "config.yaml",
        "log.txt",
        "samples",
        "tb",
    }
    monkeypatch.setattr(BanditTrainer, "setup", original)
    for name in ("mmrl", "pipelines", "rewards", "benchmarks"):  # as in a new process: no logging set up yet
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
    capsys.readouterr()
    final = main(cfg_for(tmp_path, "again", "trainer.steps=2"))
    assert final and [r["step"] for r in read_metrics(tmp_path / "again")] == [0, 1, 2]
    # the replacement is said on the console (it was logged before any handler existed, so never shown)
    err = " ".join(capsys.readouterr().err.split())
    assert "holds only what a run that stopped before its first step left; replacing it" in err
    # a folder that holds files but no run is someone's: refused even with overwrite or resume, nothing touched
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine/notes.txt").write_text("keep")
    for flags in ([], ["run.overwrite=true"], ["run.resume=true"]):
        with pytest.raises(FileExistsError, match=r"mine holds files but no run \(no config.yaml\)"):
            main(cfg_for(tmp_path, "mine", "trainer.steps=2", *flags))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert (tmp_path / "mine/notes.txt").read_text() == "keep"
    # files named like a run's are someone's too without a config.yaml; and a stopped run's tb/ holding more
    # than TensorBoard's event files is not replaced either
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/log.txt").write_text("my lab notes")
    (tmp_path / "notes/tb").mkdir()
    (tmp_path / "notes/tb/important.csv").write_text("1,2")
    for flags in ([], ["run.overwrite=true"], ["run.resume=true"]):
        with pytest.raises(FileExistsError, match=r"notes holds files but no run \(no config.yaml\)"):
            main(cfg_for(tmp_path, "notes", "trainer.steps=2", *flags))
    assert (tmp_path / "notes/log.txt").read_text() == "my lab notes"
    (tmp_path / "notes/config.yaml").write_text("recipe: bandit\n")
    (tmp_path / "notes/command.txt").write_text("mmrl train c.yaml\n")
    with pytest.raises(FileExistsError, match=r"notes already holds a run"):
        main(cfg_for(tmp_path, "notes", "trainer.steps=2"))
    assert (tmp_path / "notes/tb/important.csv").read_text() == "1,2"


@pytest.mark.parametrize("flags", [[], ["run.overwrite=true"], ["run.resume=true"]])
def test_a_folder_holding_the_users_own_config_is_refused_not_replaced(tmp_path, flags, capsys) -> None:
    """`mmrl train exps/myexp/config.yaml run.output_dir=exps run.name=myexp`: a config.yaml without the
    command.txt every run writes beside it is the user's file, never a failed setup to replace."""
    from mmrl.cli import main as cli_main

    (tmp_path / "exps/myexp").mkdir(parents=True)
    config = tmp_path / "exps/myexp/config.yaml"
    text = "# my experiment: the bandit, shorter\nrecipe: bandit\ntrainer:\n  steps: 2  # enough\n"
    config.write_text(text)
    argv = [
        "train",
        str(config),
        f"run.output_dir={tmp_path / 'exps'}",
        "run.name=myexp",
        "run.progress=false",
    ]
    assert cli_main([*argv, *flags]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"mmrl: error: FileExistsError: {tmp_path / 'exps/myexp'} holds files but no run (a config.yaml "
        "without the command.txt a run writes beside it); mmrl writes a run only into an empty folder or its "
        "own run directory and never replaces another folder: choose another run.name or run.output_dir"
        in err
    )
    assert config.read_text() == text and [p.name for p in config.parent.iterdir()] == ["config.yaml"]


def finished(tmp_path, name, *overrides):
    """A bandit run of 2 steps, checkpointed at its end."""
    main(cfg_for(tmp_path, name, "trainer.steps=2", *overrides))
    return tmp_path / name


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (["world.seed=1", "trainer.lr=0.2"], ["world.seed: 0 -> 1", "trainer.lr: 0.1 -> 0.2"]),
        (["policy.kind=tabular"], ['policy.kind: "linear" -> "tabular"']),
        (["world.dim=8"], ["world.dim: 16 -> 8"]),
    ],
)
def test_a_resume_that_changes_what_the_run_computes_is_refused_naming_each_key(
    tmp_path, changes, named
) -> None:
    """A new seed or learning rate would continue the run silently under another config, another policy or
    world size would fail in torch naming no key: each is refused before anything loads, naming every key."""
    run = finished(tmp_path, "r")
    metrics = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as err:
        main(cfg_for(tmp_path, "r", "trainer.steps=3", "run.resume=true", *changes))
    message = str(err.value)
    assert message.startswith(f"run.resume: this config changes what the run in {run} computes (config.yaml")
    assert (
        all(f"\n  {line}" in message for line in named)
        and "trainer.steps" not in message.split("\nrestore")[0]
    )
    assert f"run.resume_changes=[{','.join(c.split('=')[0] for c in changes)}]" in message
    assert (run / "metrics.jsonl").read_text() == metrics and not list(run.glob("config.resumed-*"))


def test_a_resume_accepts_observing_keys_and_the_changes_listed_in_resume_changes(tmp_path) -> None:
    run = finished(tmp_path, "r")
    observed = [
        "trainer.steps=3",
        "trainer.eval_every=1",
        "run.threads=1",
        "run.log_every=2",
        "run.keep_last=1",
    ]
    main(cfg_for(tmp_path, "r", "run.resume=true", *observed))
    assert read_metrics(run)[-1]["step"] == 3
    log = (run / "log.txt").read_text()
    assert "INFO mmrl.run: resuming with trainer.steps: 2 -> 3" in log
    # a section listed accepts every key below it; the run's config is now the resumed one
    main(
        cfg_for(
            tmp_path,
            "r",
            "run.resume=true",
            *observed,
            "trainer.steps=4",
            "trainer.lr=0.2",
            "world.seed=1",
            "run.resume_changes=[trainer.lr, world]",
        )
    )
    log = (run / "log.txt").read_text()
    assert "WARNING mmrl.run: resuming with trainer.lr: 0.1 -> 0.2 (run.resume_changes accepts it)" in log
    assert "WARNING mmrl.run: resuming with world.seed: 0 -> 1 (run.resume_changes accepts it)" in log
    recorded = load_yaml(run_config_file(run))
    assert recorded["trainer"]["lr"] == 0.2 and recorded["trainer"]["steps"] == 4
    assert load_yaml(run / "config.yaml")["trainer"]["steps"] == 2  # the original record is kept
    # the accepted values are the run's from now on: resuming with them changes nothing
    main(
        cfg_for(
            tmp_path, "r", "run.resume=true", *observed, "trainer.steps=5", "trainer.lr=0.2", "world.seed=1"
        )
    )
    assert load_yaml(run_config_file(run))["trainer"]["steps"] == 5


def test_eval_and_report_read_the_config_a_resumed_run_continued_with(tmp_path, monkeypatch, capsys) -> None:
    import mmrl.bandit.trainer as bandit
    from mmrl.cli import main as cli_main
    from mmrl.report import render_report

    run = finished(tmp_path, "r")
    main(cfg_for(tmp_path, "r", "trainer.steps=3", "run.resume=true"))
    assert run_config_file(run).name.startswith("config.resumed-")
    assert "<th>steps</th><td>3 of 3</td>" in render_report(run)
    seen = {}

    def evaluate(cfg, prompts, out, checkpoint, images_per_prompt):
        seen.update(steps=cfg.trainer.steps, checkpoint=checkpoint.name)
        out.mkdir(parents=True)
        return {}

    monkeypatch.setattr(bandit, "evaluate", evaluate, raising=False)
    assert cli_main(["eval", str(run)]) == 0
    assert seen == {"steps": 3, "checkpoint": "step_00000003"}
    # an --out that is a file is refused before the evaluation runs
    seen.clear()
    (tmp_path / "results.json").write_text("{}")
    assert cli_main(["eval", str(run), "--out", str(tmp_path / "results.json")]) == 2
    assert f"--out {tmp_path / 'results.json'}: {tmp_path / 'results.json'} is a file, not a folder" in (
        capsys.readouterr().err
    )
    assert not seen


@pytest.mark.parametrize("name", [".", "''", "..", "../elsewhere", "a/../../b", "/tmp/abs"])
def test_a_run_name_must_be_a_folder_inside_output_dir(tmp_path, name) -> None:
    """run.overwrite deletes the run directory: a name that points at output_dir itself, above it or elsewhere
    is refused when the config loads, naming the key."""
    (tmp_path / "other_run.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"run\.name.*is not a folder inside run\.output_dir"):
        cfg_for(tmp_path, name, "run.overwrite=true")
    assert (tmp_path / "other_run.txt").read_text() == "keep"


def test_resuming_a_finished_run_is_refused_and_keeps_its_summary(tmp_path) -> None:
    main(cfg_for(tmp_path, "done", "trainer.steps=2"))
    summary = (tmp_path / "done/summary.json").read_text()
    assert len(json.loads(summary)) > 2
    for steps in (2, 1):
        with pytest.raises(
            ValueError, match=rf"at step 2 and trainer.steps={steps}: nothing is left to train"
        ):
            main(cfg_for(tmp_path, "done", f"trainer.steps={steps}", "run.resume=true"))
    assert (tmp_path / "done/summary.json").read_text() == summary
    resumed = main(cfg_for(tmp_path, "done", "trainer.steps=3", "run.resume=true"))  # more steps: continues
    assert resumed and [r["step"] for r in read_metrics(tmp_path / "done")][-1] == 3


def test_resume_and_overwrite_together_are_refused(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"run\.resume continues the run directory and run\.overwrite deletes it"
    ):
        cfg_for(tmp_path, "r", "run.resume=true", "run.overwrite=true")


def test_output_dir_expands_the_home_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cfg_for(tmp_path, "r", "run.output_dir=~/runs").run.output_dir == str(tmp_path / "runs")


def test_non_finite_metrics_are_left_out_and_lines_stay_json(tmp_path) -> None:
    cfg = cfg_for(tmp_path, "nan")
    run = Run(cfg.run, cfg)
    run.log_metrics(0, {"eval/accuracy": 0.5, "eval/accuracy_count": float("nan"), "loss": float("inf")})
    run.write_summary({"step": 0, "eval/accuracy": 0.5, "eval/accuracy_count": float("nan")})
    run.close()
    assert json.loads((tmp_path / "nan/summary.json").read_text()) == {"step": 0, "eval/accuracy": 0.5}
    text = (tmp_path / "nan/metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    record = json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name} in metrics.jsonl"))
    assert record["eval/accuracy"] == 0.5 and "eval/accuracy_count" not in record and "loss" not in record


def test_eval_refuses_to_write_into_a_run_directory(tmp_path, capsys) -> None:
    from mmrl.cli import main as cli_main

    main(cfg_for(tmp_path, "trained", "trainer.steps=1"))
    summary = (tmp_path / "trained/summary.json").read_text()
    out = tmp_path / "trained"
    assert cli_main(["eval", "configs/demo/flow_shapes.yaml", "--out", str(out)]) == 2
    assert f"--out {out} is a run directory" in capsys.readouterr().err
    assert (tmp_path / "trained/summary.json").read_text() == summary


def test_resuming_a_run_of_another_recipe_is_refused_before_loading(tmp_path) -> None:
    from mmrl.flow.config import FlowGRPOConfig

    main(cfg_for(tmp_path, "bandit_run", "trainer.steps=1"))
    flow = load_config(
        FlowGRPOConfig,
        "configs/demo/flow_shapes.yaml",
        [f"run.output_dir={tmp_path}", "run.name=bandit_run", "run.resume=true"],
    )
    with pytest.raises(ValueError, match=r"bandit_run holds a bandit run and this config is flow_grpo"):
        Run(flow.run, flow)
    assert not list((tmp_path / "bandit_run").glob("config.resumed-*"))
