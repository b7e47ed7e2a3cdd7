"""Export a run's checkpoint as what the base model's own library loads, with a model card (``mmrl export``).

What is written to ``--to`` (a new or empty folder):

=========================  ===================================================================================
run                        export (and how it loads)
=========================  ===================================================================================
flow, LoRA                 ``pytorch_lora_weights.safetensors``: ``pipe.load_lora_weights(DIR)`` on the base
                           pipeline
flow, LoRA, ``--merge``    the whole diffusers pipeline folder, LoRA merged (``W + s B A``):
                           ``DiffusionPipeline.from_pretrained(DIR)``
flow, full fine-tune       the whole diffusers pipeline folder with the trained transformer
VLM, LoRA                  the peft adapter and the processor: ``PeftModel.from_pretrained(base, DIR)``,
                           ``AutoProcessor.from_pretrained(DIR)``
VLM, LoRA, ``--merge``     the merged model and the processor: ``AutoModelForImageTextToText.from_pretrained(DIR)``
VLM, full fine-tune        the trained model and the processor, as ``--merge``
=========================  ===================================================================================

Every export also holds ``README.md`` (a Hugging Face model card: license, base model, library, tags; the
recipe, the rewards, the held-out scores at the start and at the exported step, the launch command) and
``training_config.yaml`` (the config the run ended with, :func:`mmrl.run.run_config_file`, as a fresh run:
``mmrl train training_config.yaml`` trains it again).
:func:`push_to_hub` uploads the folder with ``huggingface_hub``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import yaml

from mmrl.checkpoint import latest_checkpoint, publish_folder
from mmrl.config import ConfigError, load_yaml, to_yaml, validate
from mmrl.recipes import get_recipe
from mmrl.run import changes_since, format_change, read_metrics, run_config_file

__all__ = ["export_run", "model_card", "push_to_hub"]

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
CONFIG_FILE = "training_config.yaml"


def _checkpoint_dir(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    if step is None:
        found = latest_checkpoint(root)
        if found is None:
            raise FileNotFoundError(f"run directory {run_dir} has no checkpoint to export")
        return found
    path = root / f"step_{step:08d}"
    if not path.is_dir():
        steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if p.is_dir())
        raise FileNotFoundError(f"{run_dir} has no checkpoint at step {step}; its checkpoints: {steps}")
    return path


def _base_license(base: str) -> str | None:
    """The ``license`` of a local base model's card front matter (``README.md`` or ``card.md``), if any."""
    for name in ("README.md", "card.md"):
        card = Path(base) / name
        if card.is_file():
            text = card.read_text()
            if text.startswith("---\n") and "\n---" in text[4:]:
                front = yaml.safe_load(text[4 : text.index("\n---", 4)]) or {}
                if isinstance(front, dict) and front.get("license"):
                    return str(front["license"])
    return None


def _eval_scores(run_dir: Path, step: int) -> list[tuple[str, float, float]]:
    """``(key, first value, value at the last evaluation up to step)`` of every held-out score the run logged."""
    if not (run_dir / "metrics.jsonl").is_file():
        return []
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for record in read_metrics(run_dir):
        if record.get("step", 0) > step:
            break
        for key, value in record.items():
            if key.startswith("eval/") and isinstance(value, int | float):
                first.setdefault(key, float(value))
                last[key] = float(value)
    return [(key, first[key], last[key]) for key in sorted(last)]


def model_card(
    run_dir: Path, cfg: Any, step: int, library: str, weights: str, license: str, usage: str
) -> str:
    """The model card (``README.md``) of an export: front matter the Hub reads, then what was trained and how.

    Args:
        run_dir: the run directory (``metrics.jsonl`` gives the held-out scores, ``command.txt`` the command).
        cfg: the run's validated config.
        step: the exported checkpoint's step.
        library: ``diffusers``, ``transformers`` or ``peft`` (the card's ``library_name``).
        weights: what the folder holds, in words (e.g. "LoRA adapter (rank 16)").
        license: the card's license field.
        usage: a Python snippet that loads the export.
    """
    from huggingface_hub import ModelCard, ModelCardData

    base = cfg.model.path
    local_base = Path(base).exists()
    flow = cfg.recipe == "flow_grpo"
    tags = ["mmrl", "reinforcement-learning", "flow-grpo" if flow else "rlvr"]
    if library == "peft" or "LoRA" in weights:
        tags.append("lora")
    data = ModelCardData(
        license=license,
        library_name=library,
        base_model=None if local_base else base,  # the Hub's field takes a repository id
        pipeline_tag="text-to-image" if flow else "image-text-to-text",
        tags=tags,
    )
    t = cfg.trainer
    if flow:
        recipe = (
            f"flow-matching RL (`trainer.objective={t.objective}`, `sampling.rollout={cfg.sampling.rollout}`)"
        )
    else:
        recipe = f"RLVR (`trainer.mode={t.mode}`" + (
            f", `trainer.advantage={t.advantage}`)" if t.mode == "group" else ")"
        )
    rewards = "\n".join(
        f"- `{spec.name}` weight {spec.weight}"
        + (f", options `{json.dumps(spec.options)}`" if spec.options else "")
        for spec in cfg.rewards
    )
    eval_specs = getattr(cfg, "eval_rewards", None)
    if eval_specs:
        rewards += "\n\nEvaluated with: " + ", ".join(
            f"`{spec.name}` {json.dumps(spec.options)}" for spec in eval_specs
        )
    scores = _eval_scores(run_dir, step)
    score_table = (
        f"| held-out metric | step 0 | step {step} |\n| --- | --- | --- |\n"
        + "\n".join(f"| `{k}` | {a:.4f} | {b:.4f} |" for k, a, b in scores)
        if scores
        else "No held-out evaluation was logged."
    )
    training = f"LoRA rank {cfg.model.lora.rank}" if cfg.model.lora is not None else "full fine-tuning"
    command_file = run_dir / "command.txt"
    command = command_file.read_text().strip() if command_file.is_file() else "(not recorded)"
    resumed = {
        k: v for k, v in changes_since(run_dir / "config.yaml", cfg).items() if not k.startswith("run.")
    }
    resumed_note = (
        "\n- resumed with "
        + ", ".join(f"`{format_change(k, a, b)}`" for k, (a, b) in resumed.items())
        + f": `{CONFIG_FILE}` holds the final values, so training it from step 0 matches this run only where "
        "they did not change the steps before the resume"
        if resumed
        else ""
    )
    license_note = (
        "\n\nThe license field was not known: set it to the base model's license (`mmrl export --license`)."
        if license == "other"
        else ""
    )
    body = f"""
# {cfg.run.name}

{weights} of `{base}`, trained with mmrl, {recipe}, for {step} of {t.steps} steps
(run `{cfg.run.name}`, seed {cfg.run.seed}).

## Rewards

{rewards}

## Held-out scores

{score_table}

## Training

- command: `{command}`
- reproduce: `mmrl train {CONFIG_FILE}` (the run's resolved config, in this folder){resumed_note}
- learning rate {t.lr}, {training}

## Use

```python
{usage.strip()}
```
{license_note}
"""
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))


def _check_files(ckpt: Path) -> None:
    """Refuse a checkpoint whose weights (``.safetensors``: header and extent) or configs (``.json``) do not
    parse, before anything is written: a copy would ship them broken, a merge would fail naming no file."""
    from safetensors import safe_open

    for file in sorted(ckpt.rglob("*")):
        try:
            if file.suffix == ".safetensors":
                with safe_open(file, "pt"):
                    pass
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except Exception as err:
            raise ValueError(
                f"{file} is damaged ({type(err).__name__}: {err}); export another checkpoint (--checkpoint STEP)"
            ) from err


def _check_target(to: Path) -> None:
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise FileExistsError(f"export folder {to} exists and is not empty; choose a new folder")


def _none_components(pipeline_dir: str | Path) -> str:
    """``", vae=None, ..."``: the components a local pipeline folder stores as null (a pipeline without a VAE or a
    third text encoder) that its class requires, which ``from_pretrained`` must then be given as ``None``."""
    index = Path(pipeline_dir) / "model_index.json"
    if not index.is_file():
        return ""
    import diffusers

    data = json.loads(index.read_text())
    optional = set(
        getattr(getattr(diffusers, str(data.get("_class_name")), None), "_optional_components", [])
    )
    names = sorted(
        k for k, v in data.items() if not k.startswith("_") and v == [None, None] and k not in optional
    )
    return "".join(f", {name}=None" for name in names)


def _export_flow(cfg: Any, ckpt: Path, to: Path, merge: bool, name: str) -> tuple[str, str, str]:
    """Writes the flow export into ``to``; returns ``(library, what the weights are, usage snippet)``, the snippet
    loading the folder by its final ``name``."""
    import torch

    from mmrl.device import DTYPES
    from pipelines.flow.adapters import load_adapter
    from pipelines.flow.adapters.wan22 import LORA_FILES

    lora_dir = ckpt / "adapter"
    # the LoRA file of each trained component: `transformer`, and Wan2.2's low-noise expert `transformer_2`
    lora_files = {c: f for c, f in LORA_FILES.items() if (lora_dir / f).is_file()}

    def load_lora_lines(folder: str) -> str:
        lines = []
        for component, file in lora_files.items():
            if component == "transformer" and len(lora_files) == 1:
                lines.append(f'pipe.load_lora_weights("{folder}")')
            elif component == "transformer":
                lines.append(f'pipe.load_lora_weights("{folder}", weight_name="{file}")')
            else:
                lines.append(
                    f'pipe.load_lora_weights("{folder}", weight_name="{file}", load_into_transformer_2=True)'
                )
        return "\n".join(lines) + "\n"

    if cfg.model.lora is not None and not lora_files:
        raise FileNotFoundError(f"{ckpt} has no LoRA weights (adapter/pytorch_lora_weights.safetensors)")
    if cfg.model.lora is not None and not merge:
        for file in lora_files.values():
            shutil.copy2(lora_dir / file, to / file)
        usage = f"""
from diffusers import DiffusionPipeline

pipe = DiffusionPipeline.from_pretrained("{cfg.model.path}"{_none_components(cfg.model.path)})
{load_lora_lines(name)}"""
        return "diffusers", f"LoRA adapter (rank {cfg.model.lora.rank})", usage
    adapter = load_adapter(
        cfg.model.family,
        cfg.model.path,
        torch_dtype=DTYPES[cfg.model.dtype],
        device=torch.device("cpu"),
        **cfg.model.options,
    )
    pipe = adapter.pipe
    if cfg.model.lora is not None:
        if list(lora_files) == ["transformer"]:
            pipe.load_lora_weights(lora_dir)
            pipe.fuse_lora()  # W + scale * B @ A into the base weights
        else:  # Wan2.2 with its low-noise expert trained
            for component, file in lora_files.items():
                into_second = {"load_into_transformer_2": True} if component == "transformer_2" else {}
                pipe.load_lora_weights(lora_dir, weight_name=file, **into_second)
            pipe.fuse_lora(components=list(lora_files))
        pipe.unload_lora_weights()
        weights = f"Diffusers pipeline with its LoRA (rank {cfg.model.lora.rank}) merged"
    else:
        # one folder per trained component: transformer, and Wan2.2's transformer_2 when its expert was trained
        folders = [
            name for name in ("transformer", "transformer_2") if (ckpt / name / "config.json").is_file()
        ]
        if not folders:
            raise FileNotFoundError(
                f"{ckpt} has no fully fine-tuned transformer folder (transformer/config.json)"
            )
        for component in folders:
            model_cls = type(getattr(pipe, component))
            trained = model_cls.from_pretrained(ckpt / component, torch_dtype=DTYPES[cfg.model.dtype])
            setattr(pipe, component, trained)
        weights = "Fully fine-tuned diffusers pipeline"
    pipe.save_pretrained(to)
    usage = f"""
from diffusers import DiffusionPipeline

pipe = DiffusionPipeline.from_pretrained("{name}"{_none_components(to)})
"""
    return "diffusers", weights, usage


def _export_vlm(cfg: Any, ckpt: Path, to: Path, merge: bool, name: str) -> tuple[str, str, str]:
    """Writes the VLM export into ``to``; returns ``(library, what the weights are, usage snippet)``, the snippet
    loading the folder by its final ``name``."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.checkpoint import load_checkpoint, load_trainable

    adapter_dir, model_dir = ckpt / "adapter", ckpt / "model"
    # the processor saved beside the weights (older checkpoints: the base model's)
    saved = adapter_dir if (adapter_dir / "processor_config.json").is_file() else model_dir
    processor = AutoProcessor.from_pretrained(
        saved if (saved / "processor_config.json").is_file() else cfg.model.path
    )
    merged_usage = f"""
from transformers import AutoModelForImageTextToText, AutoProcessor

model = AutoModelForImageTextToText.from_pretrained("{name}")
processor = AutoProcessor.from_pretrained("{name}")
"""
    if cfg.model.lora is not None:
        if not (adapter_dir / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{ckpt} has no peft adapter (adapter/adapter_config.json)")
        if not merge:
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(adapter_dir / file, to / file)
            processor.save_pretrained(to)
            usage = f"""
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

base = AutoModelForImageTextToText.from_pretrained("{cfg.model.path}")
model = PeftModel.from_pretrained(base, "{name}")
processor = AutoProcessor.from_pretrained("{name}")
"""
            return "peft", f"LoRA adapter (rank {cfg.model.lora.rank})", usage
        from peft import PeftModel

        base = AutoModelForImageTextToText.from_pretrained(cfg.model.path)
        model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()  # W + scale * B @ A
        model.save_pretrained(to)
        processor.save_pretrained(to)
        return "transformers", f"Model with its LoRA (rank {cfg.model.lora.rank}) merged", merged_usage
    if (model_dir / "config.json").is_file():
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
    else:  # a checkpoint from before full fine-tunes were saved as model folders: the base plus state.pt
        model = AutoModelForImageTextToText.from_pretrained(cfg.model.path)
        load_trainable(model, load_checkpoint(ckpt, require=("trainable",))["trainable"])
    model.save_pretrained(to)
    processor.save_pretrained(to)
    return "transformers", "Fully fine-tuned model", merged_usage


def export_run(
    run_dir: str | Path,
    to: str | Path,
    checkpoint: int | None = None,
    merge: bool = False,
    license: str | None = None,
) -> Path:
    """Export checkpoint ``checkpoint`` (a step; default the latest) of the run in ``run_dir`` into ``to``.

    See the module docstring for what is written. ``license`` defaults to the base model card's license when the
    base is a local folder with one, else ``other`` (the card then says to set it).

    Raises:
        FileNotFoundError: no config, no such checkpoint, or the checkpoint lacks the weights to export.
        FileExistsError: ``to`` exists and is not empty (nothing is overwritten).
        ValueError: the run's recipe has no model a library loads (the bandit demo), or a weights or config file
            of the checkpoint does not parse (named).
    """
    run_dir, to = Path(run_dir), Path(to)
    config_file = run_config_file(run_dir)  # a resumed run's newest config: its steps, its final settings
    data = load_yaml(config_file)
    recipe_name = str(data.get("recipe"))
    if recipe_name not in ("flow_grpo", "vlm_rlvr"):
        raise ValueError(
            f"{run_dir}: recipe {recipe_name!r} has no model to export (flow_grpo and vlm_rlvr do)"
        )
    try:
        cfg = validate(get_recipe(recipe_name).load_config_class(), data)
    except ConfigError as err:
        raise ConfigError(f"{config_file}: {err}") from None
    ckpt = _checkpoint_dir(run_dir, checkpoint)
    step = int(ckpt.name.removeprefix("step_"))
    if merge and cfg.model.lora is None:
        raise ValueError(
            f"--merge applies to LoRA runs; {run_dir} fully fine-tuned the model (exported whole anyway)"
        )
    _check_files(ckpt)
    _check_target(to)
    export = _export_flow if recipe_name == "flow_grpo" else _export_vlm
    license = license or _base_license(cfg.model.path) or "other"

    def write(folder: Path) -> None:
        library, weights, usage = export(cfg, ckpt, folder, merge, to.name)
        (folder / CARD_FILE).write_text(model_card(run_dir, cfg, step, library, weights, license, usage))
        # as a fresh run: `mmrl train` of a config with run.resume set would continue a run directory of
        # that name
        fresh = cfg.run.model_copy(update={"resume": False, "resume_changes": []})
        (folder / CONFIG_FILE).write_text(to_yaml(cfg.model_copy(update={"run": fresh})))
        logger.info("exported %s (%s) to %s", ckpt, weights, to)

    # written beside ``to`` and renamed into place: an export that fails half-way (a metrics line the card
    # cannot read, a disk that fills) leaves no folder behind, so the same command can run again
    publish_folder(to, write)
    return to


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Upload an exported folder to the Hugging Face Hub model repository ``repo_id`` (created if missing) in one
    commit; returns the commit's URL. The token comes from ``token``, ``HF_TOKEN`` or ``hf auth login``."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not (folder / CARD_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not an mmrl export (no {CARD_FILE}); run `mmrl export` first")
    api = HfApi(token=token)
    # (private=None: public unless the organisation makes new repositories private)
    api.create_repo(repo_id, repo_type="model", private=private or None, exist_ok=True)
    commit = api.upload_folder(
        folder_path=folder,
        repo_id=repo_id,
        repo_type="model",
        commit_message=f"Upload {folder.name} (mmrl export)",
    )
    return commit.commit_url
