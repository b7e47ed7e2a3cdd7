"""Typed YAML configs with dotted command-line overrides.

A recipe's config is a tree of :class:`Config` (pydantic) models: every field has a type, a default and a help
text; modes are ``Literal`` so a typo fails at load time. ``load_config`` reads YAML, applies overrides such as
``trainer.lr=1e-5`` and validates; every error names the offending key and what is allowed there.
"""

from __future__ import annotations

import datetime
import difflib
import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "Config",
    "ConfigError",
    "Field",
    "RunConfig",
    "apply_overrides",
    "describe",
    "load_config",
    "load_yaml",
    "to_yaml",
]

C = TypeVar("C", bound="Config")


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and the allowed values."""


class Config(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated, and a float field
    refuses ``.inf`` and ``.nan`` (an infinite learning rate or clip range would pass every bound check and
    surface as NaN weights steps later)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, protected_namespaces=()
    )


class RunConfig(Config):
    """Where a run writes, how it logs and checkpoints; shared by every recipe."""

    name: str = Field(
        "run",
        description="Run name; the run directory is output_dir/name (a relative path inside output_dir: not empty, "
        "not absolute, no '..').",
    )
    output_dir: str = Field("runs", description="Parent folder of run directories ('~' is the home folder).")
    seed: int = Field(
        0, strict=True, description="Global seed (python, numpy, torch); a run is reproducible from it."
    )
    log_every: int = Field(
        1, ge=1, description="Write metrics every this many steps (and at every evaluation, the last step)."
    )
    save_every: int = Field(0, ge=0, description="Checkpoint every this many steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept on disk; older ones are deleted.")
    resume: bool = Field(
        False,
        description="Continue the run in output_dir/name from its latest checkpoint (exact resume). The "
        "config may change only in keys that extend or observe the run (mmrl.run.RESUMABLE_CHANGES: "
        "trainer.steps, evaluation and sample cadence and sizes, logging, checkpoint cadence, threads); any "
        "other change is refused, naming each key, unless listed in resume_changes.",
    )
    resume_changes: list[str] = Field(
        default_factory=list,
        description="Dotted keys (a section accepts every key below it) that run.resume may change although "
        "the run then no longer is what one config trains from step 0, e.g. [trainer.lr]. Empty: such "
        "changes are refused.",
    )
    overwrite: bool = Field(False, description="Delete an existing run directory of the same name first.")
    tensorboard: bool = Field(True, description="Write TensorBoard event files under the run directory.")
    wandb: bool = Field(False, description="Also log to Weights & Biases (needs `pip install wandb`).")
    progress: bool = Field(True, description="Show a live progress bar with the latest metrics.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Python logging level: DEBUG, INFO, WARNING or ERROR."
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of this process, set in setup (null: torch's default, one per core). "
        "See threads_policy for what happens when other processes share the CPU. Ray rollout actors: "
        "pool.ray.threads.",
    )
    threads_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="adaptive: where waiting OpenMP threads spin, the CPU time other processes took during the "
        "last step decides the next: while they use the cores this process's threads need, every wait spins only "
        "briefly (libgomp's short spin, as with more threads than CPUs), and fully again once the cores are free "
        "(pipelines/threads.py); the thread count never changes. Besides, a process that starts on a busy machine "
        "makes waiting threads sleep at once (OMP_WAIT_POLICY=PASSIVE) unless OMP_WAIT_POLICY or GOMP_SPINCOUNT "
        "is set in the environment. fixed: the waits stay as the process started.",
    )

    @field_validator("name")
    @classmethod
    def _inside_output_dir(cls, name: str) -> str:
        """The run directory stays inside ``output_dir`` and is not ``output_dir`` itself: ``run.overwrite``
        deletes it, so a name that points elsewhere could delete what is not a run."""
        path = Path(name)
        if not name.strip() or path.is_absolute() or ".." in path.parts or path == Path("."):
            raise ValueError(
                f"{name!r} is not a folder inside run.output_dir: give a relative name without '..' (set "
                "run.output_dir for the parent folder)"
            )
        return name

    @model_validator(mode="after")
    def _resume_or_overwrite(self) -> RunConfig:
        if self.resume and self.overwrite:
            raise ValueError(
                "run.resume continues the run directory and run.overwrite deletes it: set one of them"
            )
        return self

    @field_validator("output_dir")
    @classmethod
    def _home(cls, output_dir: str) -> str:
        return os.path.expanduser(output_dir)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, level: Any) -> Any:
        return level.upper() if isinstance(level, str) else level


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping, where PyYAML keeps the last silently
    (a second ``trainer:`` section would reset every setting of the first to its default)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (first on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 floats that YAML 1.1 (PyYAML) reads as strings: an exponent without a '.' or without a sign (1e-1,
# 1E5, 2.5e3). Typed float fields convert such strings themselves, but free-form dicts (rewards' and
# estimators' options, model.options) would pass the string "1e-1" to code that multiplies by it.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file and line (a key given twice is one)."""
    path = Path(path)
    if not path.is_file():
        if path.is_dir():
            raise ConfigError(f"{path} is a folder, not a config file")
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from err
    if data is None:
        raise ConfigError(f"{path}: the config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _parse_value(text: str) -> Any:
    """Parse an override value as a config file's YAML (``1e-5`` -> float, ``[1,2]`` -> list, ``null``), else
    keep the string."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with ``key.sub=value`` overrides applied (values parsed as YAML)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key segment")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return out


def _model_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The sub-model class found by walking ``loc`` through ``schema``'s fields."""
    model: Any = schema
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return None
        annotation = fields[part].annotation
        candidates = [annotation, *get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model


def _describe(schema: type[BaseModel], err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            parent = _model_at(schema, loc[:-1])
            allowed = sorted(parent.model_fields) if parent else []
            hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            suggestion = f" Did you mean {hint[0]!r}?" if hint else ""
            lines.append(f"unknown key {key!r}.{suggestion} Allowed here: {allowed}")
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):
            # a section's own check across its keys: the message names them, and repeating the whole section
            # (the whole config at the top level) would bury it
            message = str(e.get("ctx", {}).get("error", e["msg"]))
            lines.append(f"{key}: {message}" if key else message)
        else:
            field_help = ""
            parent = _model_at(schema, loc[:-1])
            if parent is not None and loc and loc[-1] in parent.model_fields:
                desc = parent.model_fields[loc[-1]].description
                field_help = f" ({desc})" if desc else ""
            got = e.get("input")
            if e["type"] == "string_type" and isinstance(got, int | float | datetime.date):
                # the message would show what YAML made of the text (0123 -> 83), not what was written
                lines.append(
                    f"{key}: {_read_as(got)}, not as text; quote it to keep it text, e.g. "
                    f"{key.rsplit('.', 1)[-1]}: '...' in the file, \"{key}='...'\" on the command line"
                    f"{field_help}"
                )
            else:
                lines.append(f"{key}: {e['msg']}; got {got!r}{field_help}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _read_as(value: int | float | datetime.date) -> str:
    """What YAML 1.1 read an unquoted value as, and from which text it does so."""
    if isinstance(value, bool):
        return f"YAML read the value as the boolean {str(value).lower()} (from yes/no/on/off/true/false)"
    if isinstance(value, datetime.date):
        return f"YAML read the value as the date {value.isoformat()}"
    if isinstance(value, int):
        return f"YAML read the value as the number {value} (digits with a leading 0 are an octal number)"
    return f"YAML read the value as the number {value!r}"


def validate(schema: type[C], data: dict[str, Any]) -> C:
    """Validate ``data`` against ``schema``, turning pydantic's errors into one :class:`ConfigError`."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(schema, err)) from None


def load_config(schema: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    """Load ``path`` (YAML), apply ``overrides``, validate against ``schema``."""
    data = load_yaml(path) if path is not None else {}
    return validate(schema, apply_overrides(data, overrides or []))


def describe(cfg: BaseModel, prefix: str = "") -> list[str]:
    """One line per leaf field of ``cfg``: ``key.sub = value`` and, below it, the field's description (what it
    means, its peers' names and how to convert them). Nested configs are walked in field order."""
    lines = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            lines += describe(value, f"{key}.")
            continue
        shown = yaml.safe_dump(cfg.model_dump(mode="json", include={name})[name], default_flow_style=True)
        lines.append(f"{key} = {shown.strip().removesuffix('...').strip()}")
        if field.description:
            lines.append(f"    {field.description}")
    return lines


def to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (every field, defaults included): the record of the run."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
