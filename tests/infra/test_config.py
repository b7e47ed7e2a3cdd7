from typing import Literal

import pytest
from pydantic import model_validator

from mmrl.config import Config, ConfigError, Field, RunConfig, apply_overrides, load_config, to_yaml


class Trainer(Config):
    lr: float = Field(1e-4, gt=0, description="learning rate")
    mode: Literal["single", "group"] = "single"
    steps: int = 10


class Recipe(Config):
    recipe: str = "x"
    run: RunConfig = Field(default_factory=RunConfig)
    trainer: Trainer = Field(default_factory=Trainer)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_parse_values_and_nest(tmp_path):
    cfg = load_config(
        Recipe,
        write(tmp_path, "trainer:\n  lr: 0.1\n"),
        ["trainer.lr=1e-5", "trainer.mode=group", "run.name=abc"],
    )
    assert cfg.trainer.lr == 1e-5 and cfg.trainer.mode == "group" and cfg.run.name == "abc"
    assert apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]", "d.e=null"]) == {
        "a": {"b": 1, "c": [1, 2]},
        "d": {"e": None},
    }


def test_unknown_key_names_key_suggestion_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(Recipe, write(tmp_path, "trainer:\n  lrr: 0.1\n"))
    msg = str(err.value)
    assert "trainer.lrr" in msg and "Did you mean 'lr'" in msg and "['lr', 'mode', 'steps']" in msg


def test_bad_literal_and_type_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.mode.*'single' or 'group'"):
        load_config(Recipe, None, ["trainer.mode=grup"])
    with pytest.raises(ConfigError, match=r"trainer\.lr.*greater than 0.*learning rate"):
        load_config(Recipe, None, ["trainer.lr=-1"])
    with pytest.raises(ConfigError, match=r"trainer\.steps"):
        load_config(Recipe, None, ["trainer.steps=many"])


class Checked(Config):
    """Checks across keys, in a section and at the top level, as the recipes' configs do."""

    low: int = 1
    high: int = 2

    @model_validator(mode="after")
    def _check(self) -> "Checked":
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must be <= high ({self.high})")
        return self


class CheckedRecipe(Config):
    section: Checked = Field(default_factory=Checked)
    name: str = "x"

    @model_validator(mode="after")
    def _check(self) -> "CheckedRecipe":
        if self.name == "bad":
            raise ValueError("name: 'bad' is not allowed")
        return self


def test_checks_across_keys_say_their_message_without_repeating_the_config(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(CheckedRecipe, None, ["section.low=5"])
    assert str(err.value) == "invalid config:\n  section: low (5) must be <= high (2)"
    with pytest.raises(ConfigError) as err:
        load_config(CheckedRecipe, None, ["name=bad"])
    assert str(err.value) == "invalid config:\n  name: 'bad' is not allowed"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("trainer: [unclosed\n", "invalid YAML"),
        ("", "empty"),
        ("- a\n- b\n", "mapping"),
        # PyYAML keeps the last of two keys silently: the first section's settings would fall to their defaults
        (
            "trainer:\n  lr: 0.5\ntrainer:\n  steps: 4\n",
            r"key 'trainer' appears twice in one mapping \(first on line 1\)",
        ),
        ("trainer:\n  lr: 0.5\n  lr: 0.1\n", r"key 'lr' appears twice in one mapping \(first on line 2\)"),
    ],
)
def test_malformed_files(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(Recipe, write(tmp_path, text))


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Recipe, "/nonexistent/c.yaml")
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(Recipe, str(tmp_path))
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        load_config(Recipe, None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="is a value"):
        load_config(Recipe, write(tmp_path, "trainer:\n  lr: 0.1\n"), ["trainer.lr.x=1"])


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(Recipe, None, ["trainer.steps=3"])
    again = load_config(Recipe, write(tmp_path, to_yaml(cfg)))
    assert again == cfg


def test_describe_lists_every_leaf_with_its_value_and_description(capsys):
    """`mmrl config CONFIG --describe`: a line per leaf field, dotted key = value (overrides applied), and the
    field's description under it; nested settings are walked, a null section is one leaf."""
    from mmrl.cli import main as cli_main

    assert (
        cli_main(["config", "configs/demo/flow_shapes.yaml", "trainer.epsilon_low=0.001", "--describe"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("trainer.epsilon_low = 0.001")
    assert lines[at + 1].startswith("    Lower clip of the ratio: Flow-GRPO's clip_range")
    assert "model.lora = null" in lines and "sampling.noise_level = 0.7" in lines
    keys = [line.split(" = ")[0] for line in lines if not line.startswith("    ")]
    assert len(keys) == len(set(keys)) > 100
    assert "trainer.awm.time_type = discrete_wo_init" in lines
