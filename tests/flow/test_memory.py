"""`mmrl memory` for flow recipes: the estimate built on meta equals, part by part, the bytes a real trainer holds
after an optimizer step (tiny models on the CPU), and every published recipe gets one without a download."""

from pathlib import Path

import pytest
import torch

from mmrl.cli import main as cli_main
from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.memory import estimate_memory
from mmrl.flow.trainer import FlowGRPOTrainer
from mmrl.memory import GIB, module_bytes, tensors_bytes
from mmrl.optim import KahanAdamW
from pipelines.flow.tiny import build_tiny_pipeline
from pipelines.quant import weight_bytes
from tests.flow.test_families import family_config

# name: (family, Wan2.2's trained expert, overrides)
CASES = {
    "sd3 LoRA, EMA and old policy": ("sd3", None, ["trainer.ema_decay=0.9", "trainer.old_policy_decay=0.5"]),
    "sd3 LoRA in bfloat16": ("sd3", None, ["model.dtype=bfloat16"]),
    "sd3 full fine-tuning of a bfloat16 model, float32 master weights, KL reference": (
        "sd3",
        None,
        ["model.dtype=bfloat16", "model.lora=null", "trainer.beta=0.01", "trainer.ema_decay=0.9"],
    ),
    "sd3 pure bfloat16 full fine-tuning": (
        "sd3",
        None,
        ["model.dtype=bfloat16", "model.master_weight_dtype=bfloat16", "model.lora=null"],
    ),
    "sd3 pure bfloat16 full fine-tuning, KahanAdamW, float32 EMA and old policy": (
        "sd3",
        None,
        [
            "model.dtype=bfloat16",
            "model.master_weight_dtype=bfloat16",
            "model.lora=null",
            "trainer.optimizer=adamw_kahan",
            "trainer.ema_decay=0.9",
            "trainer.old_policy_decay=0.5",
        ],
    ),
    "sd3 full fine-tuning with a KL reference": ("sd3", None, ["model.lora=null", "trainer.beta=0.01"]),
    "sd3 LoRA with an nf4 explorer": ("sd3", None, ["explore.enabled=true", "explore.scheme=nf4"]),
    "wan22, both experts trained in full": ("wan22", "both", ["model.lora=null"]),
    "wan22, the low expert's LoRA": ("wan22", "low", []),
}
TRAINED = {None: ["transformer"], "both": ["transformer", "transformer_2"], "low": ["transformer_2"]}


def step_optimizer(trainer) -> None:
    """One optimizer step on zero gradients: AdamW makes its states at the first step a parameter has a gradient
    in, so after this every trained parameter has them."""
    for param in trainer.trainable:
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's states over every parameter (the step counters aside), by the estimate's part
    name: AdamW's two moments, and KahanAdamW's compensation beside them."""
    states = [
        tensor
        for state in optimizer.state.values()
        for key, tensor in state.items()
        if key in ("exp_avg", "exp_avg_sq", "compensation")
    ]
    name = "KahanAdamW states" if isinstance(optimizer, KahanAdamW) else "AdamW states"
    return {name: tensors_bytes(states)}


def held_bytes(trainer: FlowGRPOTrainer, component_names: list[str]) -> dict[str, int]:
    """What the trainer holds, by the estimate's part names, read from its tensors after an optimizer step."""
    pipe = trainer.adapter.pipe
    held = {f"{name} weights": module_bytes(getattr(pipe, name)) for name in component_names}
    held["gradients"] = tensors_bytes(trainer.trainable)
    held.update(optimizer_state_bytes(trainer.optimizer))
    if trainer.reference is not None:
        held["reference copy"] = module_bytes(trainer.reference)
    if trainer.ema is not None:
        held["EMA"] = tensors_bytes(trainer.ema.shadow.values())
    if trainer.old_policy is not None:
        held["old policy"] = tensors_bytes(trainer.old_policy.shadow.values())
    if trainer.explorer is not None:
        held["explorer"] = weight_bytes(trainer.explorer.module)
    return held


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_equals_what_the_trainer_holds(case, tmp_path):
    family, expert, overrides = CASES[case]
    torch.manual_seed(0)
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
    cfg = family_config(family, "nft", tmp_path, *overrides)
    if expert is not None:
        options = {**cfg.model.options, "trained_expert": expert}
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"options": options})})
    estimate = estimate_memory(cfg)
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    step_optimizer(trainer)
    parts = {part.name: part.bytes for part in estimate.parts}
    components = [name.removesuffix(" weights") for name in parts if name.endswith(" weights")]
    assert parts == held_bytes(trainer, components)
    trained = [
        p.name.removesuffix(" weights") for p in estimate.parts if p.sharded and p.name.endswith("weights")
    ]
    assert trained == TRAINED[expert]
    if cfg.trainer.ema_decay:  # evaluation swaps the EMA in and keeps the live weights meanwhile
        assert [phase.bytes for phase in estimate.phases] == [parts["gradients"]]  # the parameters' dtype


def published_recipes() -> list[Path]:
    return sorted(Path("configs/flow").glob("*.yaml"))


@pytest.mark.parametrize("path", published_recipes(), ids=lambda p: p.stem)
def test_every_published_recipe_is_estimated_without_a_download(path, monkeypatch):
    """Each recipe's architecture comes from the embedded published configs; its LoRA holds r * (in + out)
    values per targeted Linear, counted here from the layer shapes alone."""
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    cfg = load_config(FlowGRPOConfig, str(path), [])
    estimate = estimate_memory(cfg)
    parts = {part.name: part for part in estimate.parts}
    assert parts["gradients"].params > 0
    if cfg.model.lora is not None:
        from pipelines.flow.published import build_on_meta

        targets = cfg.model.lora.target_modules
        rank = cfg.model.lora.rank
        trained = [name.removesuffix(" weights") for name, part in parts.items() if name.endswith(" weights")]
        trained = [name for name in trained if parts[f"{name} weights"].sharded]
        expected = sum(
            rank * (layer.in_features + layer.out_features)
            for component, module in build_on_meta(cfg.model.path).items()
            if component in trained
            for name, layer in module.named_modules()
            if isinstance(layer, torch.nn.Linear)
            and any(name == t or name.endswith("." + t) for t in targets)
        )
        assert parts["gradients"].params == expected
    # the header's memory line quotes this estimate: its peak on one GPU, or per GPU under its FSDP launch
    header = path.read_text().split("\nrecipe:")[0].replace("\n# ", " ")
    one, eight = (f"{estimate.peak_bytes(78 * GIB, fsdp) / GIB:.1f} GiB" for fsdp in (1, 8))
    assert one in header or ("--fsdp=8" in header and eight in header), (one, eight)


def test_cli_prints_the_table_and_names_bad_input(capsys):
    assert cli_main(["memory", "configs/flow/qwen_image_ocr.yaml", "model.lora.rank=32"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen-Image, one GPU" in out
    assert "LoRA r32" in out
    # overrides after an option are overrides too; an unknown option is named
    assert cli_main(["memory", "configs/flow/qwen_image_ocr.yaml", "--fsdp", "2", "model.lora.rank=16"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen-Image, FSDP over 2 GPUs" in out
    assert "LoRA r16" in out
    assert "the trainers refuse FSDP with LoRA" in out
    with pytest.raises(SystemExit):
        cli_main(["memory", "configs/flow/qwen_image_ocr.yaml", "--fsdp", "2", "--gpus"])
    assert "unrecognized arguments: --gpus" in capsys.readouterr().err
    assert "A100/H100 80GB:" in out
    assert cli_main(["memory", "configs/flow/qwen_image_ocr.yaml", "--fsdp", "0"]) == 2
    assert "--fsdp 0" in capsys.readouterr().err
    assert cli_main(["memory", "configs/demo/core_bandit.yaml"]) == 2
    assert "applies to flow_grpo and vlm_rlvr" in capsys.readouterr().err


def test_fsdp_divides_only_what_it_shards():
    cfg = load_config(FlowGRPOConfig, "configs/flow/wan22_t2v_a14b_video.yaml", [])
    estimate = estimate_memory(cfg)
    one, eight = estimate.resident_bytes(1), estimate.resident_bytes(8)
    sharded = sum(part.bytes for part in estimate.parts if part.sharded)
    assert one - eight == pytest.approx(sharded * 7 / 8)
    frozen = {part.name for part in estimate.parts if not part.sharded}
    assert {"transformer_2 weights", "text_encoder weights", "vae weights"} <= frozen


def test_a_gpu_without_room_stops_the_run_before_loading(tmp_path, monkeypatch, caplog):
    """On a GPU the trainer checks the estimate before loading any weight: Qwen-Image's LoRA recipe holds 60.1 GiB
    before activations, so 40 GiB free stops it with the table; 139 GiB free lets it go on, saying the figure."""
    cfg = load_config(FlowGRPOConfig, "configs/flow/qwen_image_ocr.yaml", [f"run.output_dir={tmp_path}"])
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup_runtime("cpu")
    trainer.device = torch.device("cuda", 0)  # what setup_runtime resolves on a GPU machine
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (40 * GIB, 80 * GIB))
    with pytest.raises(
        MemoryError, match=r"holds 60\.1 GiB per GPU before any activation .* 40\.0 GiB free of 80\.0"
    ):
        trainer.check_memory(estimate_memory)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (139 * GIB, 141 * GIB))
    with caplog.at_level("INFO", logger="mmrl.trainer_base"):
        trainer.check_memory(estimate_memory)
    assert "60.1 GiB per GPU before activations (139.0 GiB free)" in caplog.text

    def broken(cfg):
        raise RuntimeError("a model class this estimate cannot build")

    with caplog.at_level("WARNING", logger="mmrl.trainer_base"):
        trainer.check_memory(broken)  # advice only: the run goes on
    assert "no memory estimate before loading the model (RuntimeError: a model class" in caplog.text


def test_master_weights_only_widen(tmp_path):
    """Pure bfloat16 training of Wan2.2 keeps the modules diffusers loads in float32 (its norms and embedders)
    float32; float32 master weights widen the rest; the estimate follows both."""
    build_tiny_pipeline("wan22", seed=0).save_pretrained(tmp_path / "model")
    dtypes = {}
    for master in ("bfloat16", "float32"):
        cfg = family_config(
            "wan22",
            "nft",
            tmp_path,
            "model.dtype=bfloat16",
            f"model.master_weight_dtype={master}",
            "model.lora=null",
        )
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        dtypes[master] = {p.dtype for p in trainer.trainable}
        trained = {part.name: part.bytes for part in estimate_memory(cfg).parts}["transformer weights"]
        assert trained == module_bytes(trainer.adapter.pipe.transformer)
    assert dtypes == {"bfloat16": {torch.bfloat16, torch.float32}, "float32": {torch.float32}}


def test_the_readme_shows_what_the_command_prints():
    readme = Path("README.md").read_text()
    command = "$ mmrl memory configs/flow/qwen_image_ocr.yaml\n"
    shown = readme[readme.index(command) + len(command) :].split("```")[0]
    cfg = load_config(FlowGRPOConfig, "configs/flow/qwen_image_ocr.yaml", [])
    assert shown == estimate_memory(cfg).table() + "\n"
