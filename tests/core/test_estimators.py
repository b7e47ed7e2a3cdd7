"""The advantage-estimator registry: every entry has one signature, configs read it, unknown names list the rest."""

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.core import advantages as A
from mmrl.core.estimators import (
    Advantages,
    RewardBatch,
    check_estimator,
    estimate,
    get_estimator,
    list_estimators,
    register_estimator,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.25, 1.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])  # odd groups, so mc_grpo applies too


def _batch() -> RewardBatch:
    raw = torch.stack([REWARDS, 1 - REWARDS], dim=1)
    return RewardBatch(REWARDS, GROUPS, raw, torch.tensor([1.0, 0.5]), baseline=torch.full((9,), 0.5))


@pytest.mark.parametrize("name", list_estimators())
def test_every_estimator_returns_finite_advantages_per_sample(name):
    out = estimate(name, _batch())
    assert isinstance(out, Advantages)
    assert out.adv.shape == REWARDS.shape and bool(torch.isfinite(out.adv).all())
    assert out.keep_mask().shape == REWARDS.shape and out.keep_mask().dtype == torch.bool


def test_estimators_are_the_core_formulas():
    b = _batch()
    torch.testing.assert_close(estimate("grpo", b).adv, A.group_normalized(REWARDS, GROUPS, std="group"))
    torch.testing.assert_close(estimate("dr_grpo", b).adv, A.group_normalized(REWARDS, GROUPS, std="none"))
    torch.testing.assert_close(estimate("rloo", b).adv, A.rloo(REWARDS, GROUPS))
    adv, pivot = A.median_centered(REWARDS, GROUPS)
    out = estimate("mc_grpo", b)
    torch.testing.assert_close(out.adv, adv)
    assert torch.equal(out.keep, ~pivot) and int((~out.keep).sum()) == 3  # one pivot per group
    single = estimate("single", b, center=True).adv
    torch.testing.assert_close(single, A.single_rollout(REWARDS, b.baseline, center=True))
    torch.testing.assert_close(estimate("gdpo", b).adv, A.decoupled_multi_reward(b.raw, GROUPS, b.weights))


def test_registry_metadata_drives_the_trainers():
    assert get_estimator("single").needs_baseline and get_estimator("single").single_rollout
    assert get_estimator("mc_grpo").extra_per_group == 1 and get_estimator("mc_grpo").odd_groups
    assert get_estimator("single").options() == ["center"] and get_estimator("grpo").options() == []


def test_unknown_names_and_options_are_named():
    with pytest.raises(KeyError, match=r"Available: \[.*'grpo'"):
        get_estimator("gpro")
    with pytest.raises(ValueError, match=r"registered: \[.*'rloo'"):
        check_estimator("gpro", {})
    with pytest.raises(ValueError, match=r"takes \[.center.\]"):
        check_estimator("single", {"centre": True})
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo", "a second grpo")(lambda batch: Advantages(batch.rewards))


def test_a_registered_estimator_is_usable_by_name_from_a_config():
    @register_estimator("test_centred_only", "reward minus batch mean (test entry)")
    def centred(batch: RewardBatch, scale: float = 1.0) -> Advantages:
        return Advantages(scale * (batch.rewards - batch.rewards.mean()))

    cfg = load_config(
        __import__("mmrl.bandit.trainer", fromlist=["BanditRecipeConfig"]).BanditRecipeConfig,
        overrides=["trainer.advantage=test_centred_only", "trainer.advantage_options={scale: 2.0}"],
    )
    out = estimate(cfg.trainer.advantage, _batch(), **cfg.trainer.advantage_options)
    torch.testing.assert_close(out.adv, 2.0 * (REWARDS - REWARDS.mean()))


@pytest.mark.parametrize(
    "schema, overrides",
    [
        ("mmrl.bandit.trainer:BanditRecipeConfig", ["trainer.advantage=gpro"]),
        ("mmrl.flow.config:FlowGRPOConfig", ["trainer.advantage=gpro"]),
        ("mmrl.vlm.config:VLMRLVRConfig", ["trainer.mode=group", "trainer.advantage=gpro"]),
    ],
)
def test_every_recipe_config_lists_the_registered_estimators(schema, overrides):
    module, name = schema.split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    with pytest.raises(
        ConfigError, match=r"trainer\.advantage: unknown advantage estimator .gpro.; registered"
    ):
        load_config(cls, overrides=overrides)


def test_vlm_mode_and_estimator_must_agree():
    from mmrl.vlm.config import VLMRLVRConfig

    assert load_config(VLMRLVRConfig).estimator_name == "single"
    group = load_config(VLMRLVRConfig, overrides=["trainer.mode=group", "trainer.advantage=mc_grpo"])
    assert group.group_size == 9 and group.rollouts_per_step == 16 * 9
    with pytest.raises(ConfigError, match=r"is a group estimator but trainer\.mode=single"):
        load_config(VLMRLVRConfig, overrides=["trainer.advantage=rloo"])


def test_vlm_trainer_keys_moved_to_the_allocation_section_still_load(caplog):
    from mmrl.vlm.config import VLMRLVRConfig

    with caplog.at_level("WARNING"):
        cfg = load_config(
            VLMRLVRConfig,
            overrides=["trainer.prompts_per_step=4", "trainer.rho=0.5", "trainer.center=true"],
        )
    assert (cfg.allocation.prompts_per_step, cfg.allocation.rho) == (4, 0.5)
    assert cfg.trainer.advantage_options == {"center": True}
    assert "trainer.prompts_per_step is deprecated: use allocation.prompts_per_step" in caplog.text
    alone = load_config(VLMRLVRConfig, overrides=["trainer.center=true"])
    assert alone.trainer.advantage_options == {"center": True}
    with pytest.raises(ConfigError, match="both set"):
        load_config(VLMRLVRConfig, overrides=["trainer.rho=0.5", "allocation.rho=0.7"])
