"""The VLM recipe's config: YAML's booleans for ``trainer.tis``, and values that load but cannot be meant refused
with the key named."""

import pytest

from mmrl.config import ConfigError, load_config
from mmrl.vlm.config import VLMRLVRConfig


@pytest.mark.parametrize(("text", "tis"), [("off", "off"), ("on", "on"), ("no", "off"), ("'auto'", "auto")])
def test_tis_reads_yamls_unquoted_on_and_off_in_a_file(tmp_path, text, tis):
    # YAML 1.1 reads unquoted on / off / no as booleans: docs/pools.md's `trainer.tis: off` arrived as False
    path = tmp_path / "c.yaml"
    path.write_text(f"recipe: vlm_rlvr\ntrainer:\n  tis: {text}\n")
    assert load_config(VLMRLVRConfig, path).trainer.tis == tis


@pytest.mark.parametrize(
    ("override", "tis"), [("trainer.tis=off", "off"), ("trainer.tis=on", "on"), ('trainer.tis="on"', "on")]
)
def test_tis_reads_yamls_unquoted_on_and_off_on_the_command_line(override, tis):
    cfg = load_config(VLMRLVRConfig, None, [override])
    assert cfg.trainer.tis == tis
    assert load_config(VLMRLVRConfig, None, [override, "generation.top_p=0.9"]).trainer.tis == tis


def test_tis_still_refuses_other_values():
    with pytest.raises(ConfigError, match=r"trainer\.tis: Input should be 'auto', 'on' or 'off'; got 'of'"):
        load_config(VLMRLVRConfig, None, ["trainer.tis=of"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # a cap below 1 weighs a token whose engine and trainer agree (ratio 1) by the cap, e.g. 0.5
        (["trainer.tis_cap=0.5"], r"trainer\.tis_cap: Input should be greater than or equal to 1; got 0\.5"),
        # 1 - epsilon_low <= 0: no ratio is ever clipped low
        (["trainer.epsilon_low=1.5"], r"trainer\.epsilon_low: Input should be less than 1; got 1\.5"),
        (["trainer.epsilon_low=1"], r"trainer\.epsilon_low: Input should be less than 1; got 1"),
        # greedy rollouts are not samples of the policy (and a greedy group failed at the first generate)
        (["generation.temperature=0"], r"generation\.temperature: Input should be greater than 0; got 0"),
        (
            ["generation.temperature=0", "trainer.mode=group"],
            r"generation\.temperature: Input should be greater than 0; got 0",
        ),
        # single mode has no group to drop: dynamic sampling was silently ignored
        (
            ["trainer.dynamic_sampling=true"],
            r"trainer\.dynamic_sampling=true drops the groups whose rewards are all equal; trainer\.mode=single",
        ),
    ],
)
def test_values_that_cannot_be_meant_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(VLMRLVRConfig, None, overrides)


def test_the_bounds_themselves_load():
    cfg = load_config(
        VLMRLVRConfig,
        None,
        [
            "trainer.tis_cap=1",
            "trainer.epsilon_low=0.999",
            "generation.temperature=0.01",
            "generation.eval_temperature=0",  # greedy held-out answers stay the default
            "trainer.mode=group",
            "trainer.dynamic_sampling=true",
        ],
    )
    assert (cfg.trainer.tis_cap, cfg.trainer.epsilon_low, cfg.generation.temperature) == (1.0, 0.999, 0.01)
    assert cfg.generation.eval_temperature == 0.0 and cfg.trainer.dynamic_sampling
