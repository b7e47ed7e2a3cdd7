"""The advantage-estimator registry: every entry has one signature, configs read it, unknown names list the rest."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_the_reported_rounding_case_gives_exactly_zero_for_equal_groups():
    # math_verify 1 + format weight 0.1 = 1.1 in float32; the old grpo gave -0.1065 to all ten correct answers
    w = torch.tensor([1.0, 0.1])
    raw = torch.tensor([[1.0, 1.0]] * 10 + [[0.0, 1.0]] * 10)
    res = get_estimator("grpo").fn(RewardBatch(raw @ w, torch.tensor([0] * 10 + [1] * 10), raw, w))
    assert torch.equal(res.adv, torch.zeros(20))


_GROUP_ESTIMATORS = [name for name in list_estimators() if not get_estimator(name).single_rollout]


@st.composite
def _multi_reward_groups(draw, odd: bool):
    """Float32 ``raw [N, K]`` and ``weights [K]`` whose weighted sums round (0.1, 0.3, 1.1, 2/3, ...), some
    groups repeating one raw row (constant), the others drawn freely.

    Returns ``(batch, constant [N] bool)``."""
    k = draw(st.integers(1, 3))
    weights = torch.tensor([draw(st.sampled_from([1.0, 0.1, 0.2, 0.3, 0.7, 2 / 3])) for _ in range(k)])
    row = st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, 1.1]), min_size=k, max_size=k)
    rows, ids, constant = [], [], []
    for gid in range(draw(st.integers(1, 5))):
        size = draw(st.integers(2, 12))
        size = size | 1 if odd else size
        is_constant = draw(st.booleans())
        group_rows = [draw(row)] * size if is_constant else [draw(row) for _ in range(size)]
        rows += group_rows
        ids += [gid] * size
        constant += [is_constant] * size
    raw = torch.tensor(rows, dtype=torch.float32)
    return RewardBatch(raw @ weights, torch.tensor(ids), raw, weights), torch.tensor(constant)


@pytest.mark.parametrize("name", _GROUP_ESTIMATORS)
@settings(max_examples=40)
@given(data=st.data())
def test_a_constant_group_gets_exactly_zero_advantage_for_every_estimator(name, data):
    batch, constant = data.draw(_multi_reward_groups(odd=get_estimator(name).odd_groups))
    adv = estimate(name, batch).adv
    assert bool(torch.isfinite(adv).all())
    assert torch.equal(adv[constant], torch.zeros(int(constant.sum())))


def test_registry_metadata_drives_the_trainers():
    assert get_estimator("single").needs_baseline and get_estimator("single").single_rollout
    assert get_estimator("mc_grpo").extra_per_group == 1 and get_estimator("mc_grpo").odd_groups
    assert get_estimator("single").options() == ["center", "scale"] and get_estimator("grpo").options() == [
        "center"
    ]


def test_the_estimators_options_reach_their_formulas():
    """grpo ``center: median``: group 2 (0.5, 0.25, 1) centres on 0.5; single ``scale: none``: ``r - V``."""
    median = estimate("grpo", _batch(), center="median").adv
    torch.testing.assert_close(median, A.group_normalized(REWARDS, GROUPS, center="median"))
    assert median[6] == 0.0 and median[8] > 0 > median[7]
    torch.testing.assert_close(estimate("single", _batch(), scale="none").adv, REWARDS - 0.5)


def test_unknown_names_and_options_are_named():
    with pytest.raises(KeyError, match=r"Available: \[.*'grpo'"):
        get_estimator("gpro")
    with pytest.raises(ValueError, match=r"registered: \[.*'rloo'"):
        check_estimator("gpro", {})
    with pytest.raises(ValueError, match=r"takes \[.center., .scale.\]"):
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


VLM = "mmrl.vlm.config:VLMRLVRConfig"
BANDIT = "mmrl.bandit.trainer:BanditRecipeConfig"
FLOW = "mmrl.flow.config:FlowGRPOConfig"
MC_GRPO = ["trainer.mode=group", "trainer.advantage=mc_grpo"]


def _schema(schema: str):
    module, name = schema.split(":")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize(
    "schema, overrides, message",
    [
        (  # the VLM's null budget is prompts_per_step * (num_generations + 1): 9 + 1 is even
            VLM,
            [*MC_GRPO, "trainer.num_generations=9"],
            "trainer.advantage=mc_grpo needs odd group sizes (its median is a sample): allocation.rollouts_per_step "
            "(null: allocation.prompts_per_step * (trainer.num_generations + 1) = 16 * 10) gives 160 rollouts a "
            "step, 10 (even) for each of allocation.prompts_per_step (16) prompts",
        ),
        (
            VLM,
            [*MC_GRPO, "allocation.rollouts_per_step=50"],
            "trainer.advantage=mc_grpo needs equal group sizes: allocation.rollouts_per_step gives 50 rollouts a "
            "step, not a multiple of allocation.prompts_per_step (16)",
        ),
        (
            FLOW,
            ["trainer.advantage=mc_grpo"],
            "trainer.advantage=mc_grpo needs odd group sizes (its median is a sample): allocation.rollouts_per_step "
            "gives 64 rollouts a step, 8 (even) for each of allocation.prompts_per_step (8) prompts",
        ),
        (
            BANDIT,
            ["trainer.advantage=mc_grpo", "allocation.method=knapsack"],
            "trainer.advantage=mc_grpo needs odd, equal group sizes: use allocation.method=uniform (got knapsack)",
        ),
        (
            BANDIT,
            ["trainer.advantage=rloo", "allocation.n_min=1", "allocation.method=knapsack"],
            "trainer.advantage=rloo compares the rollouts of a prompt, at least 2: allocation.n_min (1) lets "
            "allocation.method=knapsack give a prompt fewer; set allocation.n_min >= 2",
        ),
        (
            VLM,
            [
                "trainer.mode=group",
                "trainer.advantage=rloo",
                "allocation.n_min=1",
                "allocation.rollouts_per_step=20",
            ],
            "trainer.advantage=rloo compares the rollouts of a prompt, at least 2: allocation.rollouts_per_step "
            "gives 20 rollouts a step, fewer than 2 each for allocation.prompts_per_step (16) prompts",
        ),
        (  # the bounds hold for the budget the VLM derives too
            VLM,
            ["trainer.mode=group", "allocation.n_max=4"],
            "allocation.rollouts_per_step (null: allocation.prompts_per_step * trainer.num_generations = 16 * 8) "
            "= 128 must be <= allocation.prompts_per_step * allocation.n_max (16 * 4)",
        ),
    ],
)
def test_group_sizes_the_estimator_cannot_use_are_refused_at_load(schema, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(_schema(schema), overrides=overrides)
    assert str(error.value) == f"invalid config:\n  {message}"


@pytest.mark.parametrize(
    "schema, overrides",
    [
        (VLM, [*MC_GRPO, "trainer.num_generations=2"]),
        (VLM, [*MC_GRPO, "allocation.rollouts_per_step=48"]),
        (BANDIT, ["trainer.advantage=mc_grpo", "allocation.rollouts_per_step=576"]),
        (FLOW, ["trainer.advantage=mc_grpo", "allocation.rollouts_per_step=72"]),
        (BANDIT, ["trainer.advantage=rloo", "allocation.n_min=1"]),  # the uniform split gives 8 each
        (BANDIT, ["trainer.advantage=single", "allocation.n_min=1", "allocation.method=knapsack"]),
    ],
)
def test_group_sizes_the_estimator_can_use_load(schema, overrides):
    load_config(_schema(schema), overrides=overrides)


def test_vlm_gdpo_refuses_another_explicit_estimator_only_where_it_applies():
    from mmrl.vlm.config import VLMRLVRConfig

    two = ["trainer.mode=group", "trainer.multi_reward=gdpo", "rewards=[{name: exact_match}, {name: format}]"]
    assert load_config(VLMRLVRConfig, overrides=two).estimator_name == "gdpo"
    assert load_config(VLMRLVRConfig, overrides=[*two, "trainer.advantage=gdpo"]).estimator_name == "gdpo"
    for explicit in ("rloo", "mc_grpo"):
        with pytest.raises(ConfigError) as error:
            load_config(VLMRLVRConfig, overrides=[*two, f"trainer.advantage={explicit}"])
        assert str(error.value) == (
            "invalid config:\n  trainer.multi_reward=gdpo with 2 rewards trains with the gdpo estimator, not "
            f"trainer.advantage={explicit}: leave trainer.advantage null, or set trainer.multi_reward=weighted_sum "
            f"to train {explicit} on the weighted sum"
        )
    # one reward: gdpo does not apply, and mc_grpo trains on it with its pivot
    one = load_config(VLMRLVRConfig, overrides=[*MC_GRPO, "trainer.multi_reward=gdpo"])
    assert (one.estimator_name, one.group_size) == ("mc_grpo", 9)


def test_flow_gdpo_refuses_another_explicit_estimator_only_where_it_applies():
    from mmrl.flow.config import FlowGRPOConfig

    two = ["trainer.multi_reward=gdpo", "rewards=[{name: jpeg_incompressibility}, {name: shapes}]"]
    assert load_config(FlowGRPOConfig, overrides=two).estimator_name == "gdpo"
    assert load_config(FlowGRPOConfig, overrides=[*two, "trainer.advantage=gdpo"]).estimator_name == "gdpo"
    with pytest.raises(ConfigError) as error:
        load_config(FlowGRPOConfig, overrides=[*two, "trainer.advantage=rloo"])
    assert str(error.value) == (
        "invalid config:\n  trainer.multi_reward=gdpo with 2 rewards trains with the gdpo estimator, not "
        "trainer.advantage=rloo: leave trainer.advantage null, or set trainer.multi_reward=weighted_sum "
        "to train rloo on the weighted sum"
    )
    one = ["trainer.multi_reward=gdpo", "rewards=[{name: shapes}]"]
    assert load_config(FlowGRPOConfig, overrides=one).estimator_name == "grpo"  # null: grpo
    assert load_config(FlowGRPOConfig, overrides=[*one, "trainer.advantage=rloo"]).estimator_name == "rloo"


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
