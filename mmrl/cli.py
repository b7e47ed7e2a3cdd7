"""The ``mmrl`` command: ``mmrl train CONFIG key.sub=value ...`` and friends."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmrl.config import Config, ConfigError, apply_overrides, describe, load_yaml, to_yaml, validate
from mmrl.quiet import quiet_libraries
from mmrl.recipes import Recipe, get_recipe, list_recipes

__all__ = ["main"]


def _recipe_of(config_path: str, overrides: list[str]) -> tuple[Recipe, dict[str, Any]]:
    data = apply_overrides(load_yaml(config_path), overrides)
    name = data.get("recipe")
    if name is None:
        raise ConfigError(
            f"{config_path}: missing top-level key 'recipe'. Available: {sorted(list_recipes())}"
        )
    try:
        recipe = get_recipe(str(name))
    except KeyError as err:
        raise ConfigError(f"{config_path}: {err.args[0]}") from None
    return recipe, data


def _resolve(config_path: str, overrides: list[str]) -> tuple[Config, Callable[[Any], Any]]:
    recipe, data = _recipe_of(config_path, overrides)
    schema, entry = recipe.load()
    return validate(schema, data), entry


def _cmd_train(args: argparse.Namespace) -> int:
    cfg, entry = _resolve(args.config, args.overrides)
    entry(cfg)
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def _cmd_eval(args: argparse.Namespace) -> int:
    from mmrl.checkpoint import latest_checkpoint

    target = Path(args.target)
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if target.is_dir():
        from mmrl.run import run_config_file

        config_path = run_config_file(target)  # a resumed run's newest config
        if checkpoint is None:
            checkpoint = latest_checkpoint(target / "checkpoints")
            if checkpoint is None:
                raise ConfigError(f"run directory {target} has no checkpoint to evaluate")
        # one folder per checkpoint and question set, so an evaluation on other prompts keeps the last one's
        default = (
            target / "eval" / (checkpoint.name + (f"-{Path(args.prompts).stem}" if args.prompts else ""))
        )
        out = Path(args.out) if args.out else default
    else:
        config_path = target
        out = Path(args.out) if args.out else Path("runs") / "eval" / target.stem
    if (out / "config.yaml").is_file():
        raise ConfigError(
            f"--out {out} is a run directory: its summary.json would be replaced; choose another --out"
        )
    # refused before the model loads and the evaluation runs, not when the results are written
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"--out {out}: {folder} is a file, not a folder; choose another --out")
            break
    recipe, data = _recipe_of(str(config_path), args.overrides)
    cfg = validate(recipe.load_config_class(), data)
    summary = recipe.load_evaluate()(cfg, args.prompts, out, checkpoint, args.images_per_prompt)
    print(json.dumps(summary, indent=2))
    print(f"results written to {out} ({', '.join(sorted(path.name for path in out.iterdir()))})")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    recipe, data = _recipe_of(args.config, args.overrides)
    cfg = validate(recipe.load_config_class(), data)
    sys.stdout.write("\n".join(describe(cfg)) + "\n" if args.describe else to_yaml(cfg))
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    if args.fsdp < 1:
        raise ConfigError(f"--fsdp {args.fsdp}: the number of GPUs FSDP shards over is at least 1")
    recipe, data = _recipe_of(args.config, args.overrides)
    cfg = validate(recipe.load_config_class(), data)
    print(recipe.load_memory()(cfg).table(fsdp=args.fsdp))
    if args.fsdp > 1 and getattr(cfg.model, "lora", None) is not None:
        print(
            "note: the trainers refuse FSDP with LoRA (sharding a frozen base only adds all-gathers); a LoRA run "
            "launches with configs/accelerate/ddp.yaml and holds the one-GPU figures on every GPU"
        )
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    recipes = list_recipes()
    width = max(map(len, recipes))
    for name, desc in recipes.items():
        print(f"{name:{width}s}  {desc}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from mmrl.report import write_report

    print(f"report written to {write_report(args.run, args.out)}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from mmrl.report import write_comparison

    out = args.out or Path(args.runs[0]).parent
    print(f"comparison written to {write_comparison(args.runs, out)}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from mmrl.export import export_run, push_to_hub

    out = export_run(args.run, args.to, checkpoint=args.checkpoint, merge=args.merge, license=args.license)
    print(f"exported to {out}")
    if args.push_to_hub:
        print(f"uploaded to {push_to_hub(out, args.push_to_hub, private=args.private)}")
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    from rewards.server import main as serve

    usage = "mmrl serve-reward CONFIG [--host HOST] [--port PORT]"
    return int(serve(["--config", args.config, *args.extra], prog="mmrl serve-reward", usage=usage) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmrl",
        description="RL alignment of multimodal models: flow-matching GRPO, VLM RLVR, quantized rollout pools.",
    )
    verbose_help = "print an error's full traceback, and show the libraries' loading bars and messages (silenced by default)"
    parser.add_argument("--verbose", action="store_true", help=verbose_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train with a recipe config: mmrl train CONFIG [key.sub=value ...]")
    p.add_argument("config", help="YAML config (its 'recipe' key picks the trainer)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5 run.name=try2")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "eval", help="score a base model (CONFIG) or a run's checkpoint (RUN_DIR) on a prompt file"
    )
    p.add_argument("target", help="a recipe config (base model) or a run directory (its latest checkpoint)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--prompts", help="prompt file, one per line (default: the config's eval_prompts)")
    p.add_argument("--checkpoint", help="a checkpoint folder to load instead of the run's latest")
    p.add_argument(
        "--images-per-prompt",
        type=_positive_int,
        default=1,
        help="samples per prompt (flow recipes; a VLM run answers each question once, greedily)",
    )
    p.add_argument("--out", help="output folder (default: RUN_DIR/eval/CHECKPOINT or runs/eval/CONFIG)")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("config", help="validate a config and print it resolved (all defaults filled in)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument(
        "--describe", action="store_true", help="every field with its description instead of the YAML"
    )
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "memory",
        help="GPU memory a recipe holds before activations, from the published architecture (no download)",
    )
    p.add_argument("config", help="YAML config (flow_grpo or vlm_rlvr)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.lora.rank=32")
    p.add_argument("--fsdp", type=int, default=1, metavar="N", help="divide what FSDP shards over N GPUs")
    p.set_defaults(func=_cmd_memory)

    p = sub.add_parser("recipes", help="list the available recipes")
    p.set_defaults(func=_cmd_recipes)

    p = sub.add_parser("report", help="write a run's report: one offline HTML page with plots and samples")
    p.add_argument("run", help="a run directory (it may still be training)")
    p.add_argument("--out", help="folder to write report.html into (default: the run directory)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("compare", help="overlay the curves of several runs on one HTML page")
    p.add_argument("runs", nargs="+", help="two or more run directories")
    p.add_argument("--out", help="folder to write compare.html into (default: the first run's parent folder)")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "export", help="export a checkpoint as what diffusers / transformers / peft load, with a model card"
    )
    p.add_argument("run", help="a run directory")
    p.add_argument("--to", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--checkpoint", type=int, help="the step of the checkpoint to export (default: latest)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="LoRA runs: merge the adapter into the base weights and write the whole model "
        "(default: the adapter alone, loaded on top of the base model)",
    )
    p.add_argument("--license", help="the model card's license (default: the base model card's, or 'other')")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the export to this Hub model repository")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("serve-reward", help="serve a registered reward over HTTP: mmrl serve-reward CONFIG")
    p.add_argument("config", help="YAML reward-server config (see docs/rewards.md)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further server options")
    p.set_defaults(func=_cmd_serve_reward)
    for command in sub.choices.values():
        # SUPPRESS: a subcommand without the flag must not reset `mmrl --verbose COMMAND`'s choice
        command.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    return parser


#: errors in what the user gave (a config, a file, a path, data, a reward): exit status 2; anything else is 1
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, ImportError)


def error_message(err: BaseException) -> str:
    """The one message ``mmrl`` prints for an error: its text (which names the file, row or key), prefixed by
    the type's name where the type says something the text does not."""
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    if type(err) in (ValueError, RuntimeError, ConfigError, KeyError) or not text:
        return text or type(err).__name__
    return f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every error ends as one ``mmrl: error: ...`` message on stderr (exit status 2 for bad
    input, 1 for anything else); ``--verbose`` prints the traceback before it. A rank of a multi-process launch
    does not return: it exits with the status (:func:`mmrl.distributed.end_launched_process`)."""
    parser = build_parser()
    # overrides may follow an option (`mmrl memory CONFIG --fsdp 8 model.lora.rank=32`), which argparse's
    # positional list stops at: the leftover key=value words are the command's overrides
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(word.startswith("-") or "=" not in word for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    quiet_libraries(args.verbose)
    status = _run_command(args)
    if "torch" in sys.modules:  # only a command that loaded torch can have joined a process group
        from mmrl.distributed import end_launched_process, is_launched_rank

        if is_launched_rank():
            end_launched_process(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("mmrl: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.verbose:
            traceback.print_exc()
        hint = "" if args.verbose else " (mmrl --verbose ... prints the traceback)"
        user = isinstance(err, USER_ERRORS)
        print(f"mmrl: error: {error_message(err)}{'' if user else hint}", file=sys.stderr)
        return 2 if user else 1


if __name__ == "__main__":
    raise SystemExit(main())
