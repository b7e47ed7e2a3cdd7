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


class Free(Config):
    options: dict = Field(default_factory=dict)
    name: str = "x"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-1", 0.1), ("1E5", 1e5), ("-2.5e-3", -2.5e-3), ("+3e2", 300.0), ("1.5e3", 1500.0), (".5e1", 5.0)],
)
def test_exponent_floats_are_floats_in_free_form_options_as_in_yaml_1_2(tmp_path, text, value):
    """PyYAML (YAML 1.1) reads 1e-1 as a string; typed fields convert it, a free-form dict (rewards' options)
    handed the string to code that multiplies by it. Files and overrides read it the same way."""
    from_file = load_config(Free, write(tmp_path, f"options: {{w: {{object: {text}}}}}\n"))
    from_override = load_config(Free, None, [f"options.w.object={text}"])
    for cfg in (from_file, from_override):
        assert cfg.options["w"]["object"] == value and type(cfg.options["w"]["object"]) is float


@pytest.mark.parametrize("text", ["1e", "e5", "1e-", "1.2.3e4", "1e5x", "e-5"])
def test_what_only_looks_like_an_exponent_float_stays_a_string(tmp_path, text):
    cfg = load_config(Free, write(tmp_path, f"options: {{w: {text}}}\n"), [f"options.v={text}"])
    assert cfg.options == {"w": text, "v": text}


def test_a_flow_config_with_an_exponent_in_a_rewards_options_loads_it_as_a_float(tmp_path):
    from mmrl.flow.config import FlowGRPOConfig

    rewards = "rewards: [{name: shapes, options: {partial: true, criterion_weights: {object: 1e-1}}}]\n"
    path = write(tmp_path, rewards)
    assert load_config(FlowGRPOConfig, path).rewards[0].options["criterion_weights"] == {"object": 0.1}


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400"])
def test_an_infinite_or_nan_float_is_refused_naming_the_key(value):
    """An infinite learning rate passes `gt=0` and turns the weights to NaN at the first step."""
    with pytest.raises(ConfigError, match=r"trainer\.lr: Input should be a finite number; got (-?inf|nan)"):
        load_config(Recipe, None, [f"trainer.lr={value}"])


@pytest.mark.parametrize(
    ("value", "read_as"),
    [
        ("0123", "the number 83 (digits with a leading 0 are an octal number)"),
        ("2024-06-01", "the date 2024-06-01"),
        ("no", "the boolean false (from yes/no/on/off/true/false)"),
        ("1.5", "the number 1.5"),
    ],
)
def test_a_text_field_given_a_number_date_or_bool_says_how_yaml_read_it_and_to_quote_it(value, read_as):
    with pytest.raises(ConfigError) as err:
        load_config(Recipe, None, [f"run.name={value}"])
    assert (
        f"run.name: YAML read the value as {read_as}, not as text; quote it to keep it text, e.g. "
        "name: '...' in the file, \"run.name='...'\" on the command line" in str(err.value)
    )
    assert load_config(Recipe, None, [f"run.name='{value}'"]).run.name == value
