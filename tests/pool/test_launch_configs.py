"""The accelerate configs go through accelerate's own launch path: parsed, validated, turned into the env."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_multi_gpu_env

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_accelerate_config_launches_the_cli(name, monkeypatch):
    command = [
        "--config_file",
        str(CONFIGS / f"{name}.yaml"),
        "-m",
        "mmrl.cli",
        "train",
        "recipe.yaml",
        "a.b=1",
    ]
    args = _validate_launch_command(launch_command_parser().parse_args(command))[0]
    assert (args.module, args.training_script, args.training_script_args) == (
        True,
        "mmrl.cli",
        ["train", "recipe.yaml", "a.b=1"],
    )
    assert args.num_processes == 8 and args.num_machines == 1
    env = prepare_multi_gpu_env(args)
    if name == "ddp":
        assert args.multi_gpu and "ACCELERATE_USE_FSDP" not in env
        return
    assert args.use_fsdp and env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    # the plugin a trainer's Accelerator builds from this environment accepts every option
    from accelerate.utils import FullyShardedDataParallelPlugin

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.auto_wrap_policy is not None
