"""The VLM RLVR trainer on a tiny random Qwen2.5-VL: single and group modes, LoRA-only updates, checkpoints."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmrl.cli import main as cli_main
from mmrl.config import load_config
from mmrl.data.shapes_math import Step, format_completion, format_trace, make_count_items, make_math_items
from mmrl.data.shapes_vqa import make_vqa_items
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.trainer import (
    VLMRLVRTrainer,
    clip_metrics,
    evaluate,
    load_examples,
    main,
    policy_loss,
    ratio_logprobs,
)
from pipelines.vlm.backend import GenerationBackend
from pipelines.vlm.tiny import build_tiny_vlm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    items = make_vqa_items(60, seed=0)
    corpus = [i.prompt for i in items] + [f"<answer>{i.answer}</answer>" for i in items]
    path = tmp_path_factory.mktemp("tiny_vlm")
    build_tiny_vlm(corpus, out_dir=path)
    return path


def make_cfg(model_dir, out, name, *overrides):
    return load_config(
        VLMRLVRConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={out}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "data.train_limit=24",
            "data.eval_limit=8",
            "generation.max_new_tokens=6",
            "allocation.prompts_per_step=4",
            "trainer.steps=1",
            "trainer.lr=1e-2",
            "trainer.minibatch_size=4",
            "trainer.num_generations=3",
            # random weights never answer right: score the format so advantages are not all zero
            "rewards=[{name: exact_match}, {name: format, options: {}, weight: 0.0}]",
            *overrides,
        ],
    )


@pytest.mark.parametrize(
    "mode",
    [
        ["trainer.mode=single"],
        ["trainer.mode=group", "trainer.advantage=grpo"],
        ["trainer.mode=group", "trainer.advantage=mc_grpo", "trainer.num_generations=2"],
    ],
)
def test_one_step_trains_only_lora(model_dir, tmp_path, mode):
    cfg = make_cfg(model_dir, tmp_path, "m", *mode)
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    named = dict(trainer.model.named_parameters())
    lora = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert not any("visual" in n for n in lora)  # vision tower frozen by default
    # force a learning signal: fake rewards with spread
    original = trainer.score_samples

    def spread(pairs):
        _, raw, outputs = original(pairs)
        fake = torch.arange(len(pairs), dtype=torch.float32) % 2
        return fake, raw, outputs

    trainer.score_samples = spread
    metrics = trainer.train_step()
    assert "loss" in metrics and "entropy/mean" in metrics and "policy/kl" in metrics
    assert metrics["tis/logprob_mismatch"] < 1e-4  # the trainer re-scores what the HF backend sampled
    assert any(not torch.equal(lora[n], named[n]) for n in lora)
    assert all(torch.equal(frozen[n], named[n]) for n in frozen)


def _spread_rewards(trainer):
    """Fake rewards 0, 1, 0, 1, ... so every step has a learning signal (random weights never answer right)."""
    original = trainer.score_samples

    def spread(pairs):
        _, raw, outputs = original(pairs)
        return torch.arange(len(pairs), dtype=torch.float32) % 2, raw, outputs

    trainer.score_samples = spread


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_bfloat16_model_trains_float32_master_weights(model_dir, tmp_path, lora):
    """The trained parameters (LoRA factors, or the language model) are float32 master weights of the bfloat16
    model, which generates and is scored under bfloat16 autocast, so the trainer's re-scored log-probs are those
    the rollout sampled from; the frozen weights (the vision tower, a LoRA's base) and the KL reference stay
    bfloat16."""
    extra = [] if lora else ["model.lora=null", "trainer.beta=0.01"]
    cfg = make_cfg(model_dir, tmp_path, "master", "model.dtype=bfloat16", "trainer.mode=single", *extra)
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    assert {p.dtype for p in trainer.trainable} == {torch.float32}
    assert {p.dtype for p in trainer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert trainer.backend.autocast_dtype == torch.bfloat16
    if not lora:
        assert {p.dtype for p in trainer.reference.parameters()} == {torch.bfloat16}
    _spread_rewards(trainer)
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    # both forwards in bfloat16 from the same weights (full fine-tuning scored without autocast: 4.3e-4)
    assert metrics["tis/logprob_mismatch"] < 1e-4
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    assert {p.dtype for p in trainer.trainable} == {torch.float32}


@pytest.mark.parametrize(
    ("master", "optimizer"),
    [("float32", "adamw"), ("bfloat16", "adamw"), ("bfloat16", "adamw_kahan")],
    ids=["master-weights", "pure-bfloat16", "pure-bfloat16-kahan"],
)
def test_a_small_step_survives_only_in_master_weights_or_the_compensation(
    model_dir, tmp_path, master, optimizer
):
    """AdamW's first step moves every weight with a gradient by about lr = 1e-6; a bfloat16 weight of the median
    magnitude here (0.013) has an ulp of 6.1e-5, so in pure bfloat16 (``model.master_weight_dtype=bfloat16``) the
    step rounds away for all but the smallest weights, while float32 master weights keep it for every one, and so
    does KahanAdamW (``trainer.optimizer=adamw_kahan``) in the weight plus its compensation buffer, which holds
    what the bfloat16 weight could not take and adds it back at the next step."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        master,
        "model.lora=null",
        "model.dtype=bfloat16",
        f"model.master_weight_dtype={master}",
        f"trainer.optimizer={optimizer}",
        "trainer.mode=single",
        "trainer.lr=1e-6",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    assert trainer.backend.autocast_dtype == (torch.bfloat16 if master == "float32" else None)
    _spread_rewards(trainer)
    weights = {
        n: p for n, p in trainer.model.named_parameters() if p.requires_grad and n.endswith("proj.weight")
    }
    before = {n: p.detach().float().clone() for n, p in weights.items()}
    trainer.train_step()

    def held(param):  # what the optimizer holds of a weight
        state = trainer.optimizer.state[param]
        return param.detach().float() + (state["compensation"].float() if "compensation" in state else 0)

    moved = torch.cat([(held(weights[n]) != before[n]).flatten() for n in weights])
    assert (
        moved.float().mean() > 0.9
        if optimizer == "adamw_kahan" or master == "float32"
        else moved.float().mean() < 0.1
    )
    if optimizer == "adamw_kahan":
        steps = torch.cat([(held(weights[n]) - before[n]).abs().flatten() for n in weights])
        assert steps.median() == pytest.approx(1e-6, rel=0.05)  # the whole first AdamW step, lr * g / |g|


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss", ["clip", "cispo"])
def test_policy_loss_gradients_by_hand(tmp_path, loss, level):
    """d loss / d logp_t for two completions (3 and 2 tokens, advantages +1 and -1) against the formulas:
    clip: -rho A inside the trust region, 0 where the clip binds; cispo: -min(rho, 5) A for every token; rho is
    the token's ratio, or under GSPO the completion's exp(mean_t log ratio), the same for its every token."""
    settings = make_cfg("unused", tmp_path, "loss", f"trainer.policy_loss={loss}").trainer
    settings.importance_sampling_level = level
    ratios = torch.tensor([[1.1, 9.0, 0.5], [1.5, 1.2, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    old = torch.full((2, 3), -1.0)
    logp = (old + ratios.log()).requires_grad_()
    ratio_logp = ratio_logprobs(settings, logp, old, mask)
    (policy_loss(settings, ratio_logp, old, adv) * mask).sum().backward()
    if (
        level == "sequence"
    ):  # geometric means over each completion's tokens: (1.1 * 9 * 0.5)^(1/3), (1.5 * 1.2)^(1/2)
        ratios = torch.tensor([[4.95 ** (1 / 3)] * 3, [1.8**0.5] * 3])
    if loss == "cispo":
        expected = -ratios.clamp(max=5.0) * adv
    else:  # clip range [0.8, 1.28]: binds where the ratio is above 1.28 with A > 0 or below 0.8 with A < 0
        binds = ((ratios > 1.28) & (adv > 0)) | ((ratios < 0.8) & (adv < 0))
        expected = torch.where(binds, 0.0, -ratios * adv)
    torch.testing.assert_close(logp.grad, expected * mask)
    fractions = clip_metrics(settings, ratio_logp.detach(), old, adv, mask)
    if loss == "cispo":  # the token of ratio 9 is capped at 5 (at the sequence level no ratio reaches 5)
        assert float(fractions["clip/cispo_capped_frac"]) == pytest.approx(1 / 5 if level == "token" else 0.0)
    else:  # token: 9 (A > 0); sequence: the first completion's 1.70 (A > 0), three of five tokens
        assert float(fractions["clip/high_frac"]) == pytest.approx(1 / 5 if level == "token" else 3 / 5)


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "trainer.importance_sampling_level=sequence",
            "trainer.epsilon_low=3e-4",
            "trainer.epsilon_high=4e-4",
        ],
        ["trainer.policy_loss=cispo"],
    ],
    ids=["gspo", "cispo"],
)
def test_gspo_and_cispo_train_off_policy_epochs(model_dir, tmp_path, overrides):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "loss",
        "trainer.mode=group",
        "trainer.ppo_epochs=2",
        "trainer.loss_agg=seq_mean_token_mean",
        *overrides,
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    _spread_rewards(trainer)
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    if cfg.trainer.policy_loss == "cispo":
        assert "clip/cispo_capped_frac" in metrics and "clip/high_frac" not in metrics
    else:  # the second epoch is off-policy after a step of lr 1e-2: GSPO's 4e-4 range clips whole completions
        assert metrics["clip/high_frac"] + metrics["clip/low_frac"] > 0


def test_updates_per_step_steps_the_optimizer_per_part_with_the_samplers_old_policy(model_dir, tmp_path):
    """Two parts, two AdamW steps; the second part's old-policy log-probs are the weights' that sampled it (taken
    before the first update: their mismatch to the sampler's is float noise, where after an lr 1e-2 update it
    would not be), so its ratios move off 1 and GSPO's 4e-4 range clips whole completions."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "parts",
        "trainer.mode=group",
        "trainer.updates_per_step=2",
        "trainer.minibatch_size=3",
        "trainer.importance_sampling_level=sequence",
        "trainer.epsilon_low=3e-4",
        "trainer.epsilon_high=4e-4",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    _spread_rewards(trainer)
    lrs = []
    step_optimizer = trainer.optimizer_step

    def counted(optimizer, params, max_norm, lr):
        lrs.append(lr)
        return step_optimizer(optimizer, params, max_norm, lr=lr)

    trainer.optimizer_step = counted
    metrics = trainer.train_step()
    assert lrs == [cfg.trainer.lr, cfg.trainer.lr]  # one per part, at the training step's learning rate
    assert metrics["tis/logprob_mismatch"] < 1e-4
    assert metrics["clip/high_frac"] + metrics["clip/low_frac"] > 0
    assert metrics["policy/ratio_mean"] != 1.0


def test_more_updates_than_samples_leave_the_extra_parts_empty(model_dir, tmp_path):
    # 4 prompts x 3 completions = 12 rows in 16 parts: 12 one-row updates and 4 optimizer steps without a forward
    cfg = make_cfg(
        model_dir, tmp_path, "empty", "trainer.mode=group", "trainer.updates_per_step=16", "trainer.beta=0"
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    _spread_rewards(trainer)
    forwards, steps = [], []
    score, step_optimizer = trainer.token_stats, trainer.optimizer_step
    trainer.token_stats = lambda pairs, *args, **kwargs: (
        forwards.append(len(pairs)) or score(pairs, *args, **kwargs)
    )
    trainer.optimizer_step = lambda *args, **kwargs: steps.append(1) or step_optimizer(*args, **kwargs)
    before = [p.detach().clone() for p in trainer.trainable]
    trainer.train_step()
    assert len(steps) == 16
    # each row's gradient forward, and the later 11 rows' old-policy forwards
    assert forwards.count(1) == 12 + 11
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))


@pytest.mark.parametrize("epochs", [1, 2])
def test_update_takes_old_policy_statistics_from_the_gradient_forward(model_dir, tmp_path, epochs):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        f"fwd{epochs}",
        "trainer.mode=group",
        "trainer.beta=0",
        f"trainer.ppo_epochs={epochs}",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    pairs, _, keep, *_ = trainer.collect()
    adv = torch.arange(len(pairs), dtype=torch.float32) % 2 - 0.5
    # with dropout off, a train-mode forward with gradients gives the no-grad eval-mode statistics
    trainer.model.eval()
    with torch.no_grad():
        eval_stats = trainer.token_stats(pairs[:4], 1.0)
    trainer.model.train()
    train_stats = trainer.token_stats(pairs[:4], 1.0)
    assert train_stats.logprobs.requires_grad
    torch.testing.assert_close(train_stats.detach().logprobs, eval_stats.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(train_stats.detach().entropy, eval_stats.entropy, rtol=0, atol=1e-5)
    calls = []
    original = trainer.token_stats

    def counting(batch, temperature, model=None):
        calls.append((len(batch), torch.is_grad_enabled()))
        return original(batch, temperature, model)

    trainer.token_stats = counting
    trainer.update(pairs, adv, keep)
    minibatches = -(-int(keep.sum()) // cfg.trainer.minibatch_size)
    # one forward per minibatch and epoch, all with gradients: as many as TRL's, none spare
    assert len(calls) == epochs * minibatches and all(grad for _, grad in calls)
    metrics = trainer.metrics.reduce()
    if epochs == 1:  # every ratio is exactly 1 under the weights that sampled
        assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["clip/low_frac"] == metrics["clip/high_frac"] == 0.0


def test_zero_advantages_leave_exactly_beta_times_the_k3_kl_in_the_loss(model_dir, tmp_path):
    """With every advantage 0 the policy term is 0, so the token-mean loss is ``beta`` times the mean k3 estimate
    of the KL to the reference: added, a pull toward the reference, not away from it."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "k3",
        "trainer.mode=group",
        "trainer.beta=0.5",
        "trainer.loss_agg=token_mean",
        "trainer.minibatch_size=64",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    pairs, _, keep, *_ = trainer.collect()
    every = torch.ones_like(keep)
    trainer.update(
        pairs, torch.arange(len(pairs), dtype=torch.float32) % 2 - 0.5, every
    )  # leave the reference
    trainer.metrics.reduce()
    trainer.update(pairs, torch.zeros(len(pairs)), every)
    metrics = trainer.metrics.reduce()
    assert metrics["policy/kl"] > 1e-6
    assert metrics["loss"] == pytest.approx(0.5 * metrics["policy/kl"], rel=1e-5)


def test_main_writes_peft_adapter_and_eval(model_dir, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from pipelines.vlm.hf_backend import HFBackend

    final = main(make_cfg(model_dir, tmp_path, "run", "trainer.steps=1", "trainer.eval_every=1"))
    assert 0.0 <= final["eval/reward_mean"] <= 1.0
    adapter = tmp_path / "run/checkpoints/step_00000001/adapter"
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    PeftModel.from_pretrained(base, adapter)
    # the generation backend gets the checkpoint's weights (a vLLM engine holds its own copy of the base)
    trained = torch.load(adapter.parent / "state.pt", weights_only=False)["trainable"]
    synced = []
    monkeypatch.setattr(
        HFBackend,
        "sync_weights",
        lambda self, model: synced.append({n: p.detach().clone() for n, p in model.named_parameters()}),
    )
    summary = evaluate(
        make_cfg(model_dir, tmp_path, "run"),
        None,
        tmp_path / "eval",
        tmp_path / "run/checkpoints/step_00000001",
        1,
    )
    assert summary["questions"] == 8 and (tmp_path / "eval/answers.jsonl").is_file()
    assert len(synced) == 1 and all(torch.equal(synced[0][n], value) for n, value in trained.items())


def test_a_bfloat16_full_finetune_checkpoint_loads_and_evaluates(model_dir, tmp_path):
    """The model/ folder of a bfloat16 model trained with float32 master weights holds the master weights (the
    frozen vision tower in bfloat16): from_pretrained in bfloat16 gives them rounded, and mmrl eval resumes them
    exactly from state.pt."""
    from transformers import AutoModelForImageTextToText

    overrides = ("model.lora=null", "model.dtype=bfloat16", "trainer.beta=0")
    main(make_cfg(model_dir, tmp_path, "bf16", *overrides, "trainer.steps=1", "trainer.eval_every=1"))
    step = tmp_path / "bf16/checkpoints/step_00000001"
    trained = torch.load(step / "state.pt", weights_only=False)["trainable"]
    assert {t.dtype for t in trained.values()} == {torch.float32}
    loaded = dict(
        AutoModelForImageTextToText.from_pretrained(step / "model", dtype=torch.bfloat16).named_parameters()
    )
    for name, value in trained.items():
        assert torch.equal(loaded[name], value.to(torch.bfloat16)), name
    summary = evaluate(make_cfg(model_dir, tmp_path, "bf16", *overrides), None, tmp_path / "eval", step, 1)
    assert summary["questions"] == 8


def test_single_rollout_rl_from_the_committed_checkpoint_raises_heldout_accuracy():
    """The main job in miniature: the committed SFT checkpoint answers counts in words (as its corpus mostly did);
    25 single-rollout steps with the exact-match reward move it to the digits the questions ask for, so held-out
    exact match rises by far more than 15 points while what it reads (number words accepted) holds."""
    # the reward is exact match; a second, zero-weight copy that accepts number words logs what the model reads
    read = "{name: exact_match, options: {number_words: true}, weight: 0.0, label: read}"
    cfg = load_config(
        VLMRLVRConfig,
        "configs/demo/vlm_shapes_single.yaml",
        [
            "run.progress=false",
            "trainer.steps=25",
            "data.eval_limit=140",
            f"rewards=[{{name: exact_match}}, {read}]",
        ],
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()

    def scores():
        out = trainer.evaluate()
        return out["eval/exact_match"], out["eval/read"]

    strict_before, read_before = scores()
    for _ in range(cfg.trainer.steps):
        trainer.train_step()
        trainer.step += 1
    strict_after, read_after = scores()
    assert strict_before < 0.45 and read_before > 0.6
    assert strict_after >= strict_before + 0.15
    assert read_after >= read_before - 0.05


def test_group_mode_gdpo_normalises_each_reward_in_its_group(model_dir, tmp_path):
    from mmrl.core.advantages import decoupled_multi_reward

    cfg = make_cfg(
        model_dir,
        tmp_path,
        "g",
        "trainer.mode=group",
        "trainer.multi_reward=gdpo",
        "rewards=[{name: exact_match, weight: 2.0}, {name: format, options: {}, weight: 1.0}]",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()

    def fake_verify(pairs):
        n = len(pairs)
        raw = torch.stack([torch.arange(n) % 2, (torch.arange(n) // 2) % 2], dim=1).float()
        return raw @ trainer.reward_weights, raw

    trainer.score_samples = lambda pairs: (*fake_verify(pairs), {})
    pairs, adv, *_ = trainer.collect()
    _, raw = fake_verify(pairs)
    groups = torch.tensor(
        [[p for p in dict.fromkeys(ex.prompt_id for ex, _ in pairs)].index(ex.prompt_id) for ex, _ in pairs]
    )
    torch.testing.assert_close(adv, decoupled_multi_reward(raw, groups, torch.tensor([2.0, 1.0])))
    with pytest.raises(
        ValueError, match="multi_reward=gdpo with 2 rewards trains with the gdpo estimator, not"
    ):
        make_cfg(
            model_dir,
            tmp_path,
            "g",
            "trainer.mode=group",
            "trainer.multi_reward=gdpo",
            "trainer.advantage=mc_grpo",
        )


# Rewards (exact_match, format) by position in each of the 4 prompt groups, weighted 1 and 0.1.
_DAPO_GROUPS = {
    # MC-GRPO, G+1 = 5: binary [1,0,0,0,0] and [1,1,0,0,0] vary (every non-pivot sample stays, also the zero-
    # advantage ones tied with the median); 1.1 and 0.1 everywhere do not (all dropped)
    "mc_grpo": ([[1, 0, 0, 0, 0], [1] * 5, [1, 1, 0, 0, 0], [0] * 5], [[1] * 5, [1] * 5, [1] * 5, [1] * 5]),
    # GRPO, G = 3: graded [0, 0.5, 1] keeps its 0.5 sample (advantage 0); [1.1] * 3 and [0] * 3 are dropped
    "grpo": ([[0, 0.5, 1], [1] * 3, [1, 0, 0], [0] * 3], [[0] * 3, [1] * 3, [0] * 3, [0] * 3]),
    # GDPO, G = 2, both rewards weighted 1: group 0's sum is 1 twice, but each reward varies, so it is kept
    "gdpo": ([[1, 0], [1, 1], [1, 0], [0, 0]], [[0, 1], [1, 1], [1, 1], [0, 0]]),
}


def _scores_by_group(trainer, answer, fmt):
    """A ``score_samples`` whose answer and format scores of group g's j-th sample are ``answer[g][j]`` and
    ``fmt[g][j]``, weighted with the trainer's reward weights."""

    def scores(pairs):
        raw = torch.tensor(
            [[answer[g][j], fmt[g][j]] for g, j in _group_positions(pairs)], dtype=torch.float32
        )
        return raw @ trainer.reward_weights, raw, {}

    return scores


def _group_positions(pairs) -> list[tuple[int, int]]:
    """Each sample's (group, in order of the prompts' first appearance; position within its group)."""
    groups: dict[str, int] = {}
    positions: dict[str, int] = {}
    out = []
    for ex, _ in pairs:
        group = groups.setdefault(ex.prompt_id, len(groups))
        positions[ex.prompt_id] = positions.get(ex.prompt_id, -1) + 1
        out.append((group, positions[ex.prompt_id]))
    return out


@pytest.mark.parametrize(
    "estimator, overrides",
    [
        ("mc_grpo", ["trainer.num_generations=4"]),
        ("grpo", ["trainer.num_generations=3"]),
        (
            "gdpo",
            [
                "trainer.num_generations=2",
                "trainer.multi_reward=gdpo",
                "rewards=[{name: exact_match}, {name: format, options: {}, weight: 1.0}]",
            ],
        ),
    ],
)
def test_dynamic_sampling_keeps_exactly_the_groups_whose_rewards_vary(
    model_dir, tmp_path, estimator, overrides
):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        f"dapo_{estimator}",
        "trainer.mode=group",
        f"trainer.advantage={estimator}",
        "trainer.dynamic_sampling=true",
        "rewards=[{name: exact_match}, {name: format, options: {}, weight: 0.1}]",
        *overrides,
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    trainer.score_samples = _scores_by_group(trainer, *_DAPO_GROUPS[estimator])
    pairs, adv, keep, *_ = trainer.collect()
    order = list(dict.fromkeys(ex.prompt_id for ex, _ in pairs))
    group = torch.tensor([order.index(ex.prompt_id) for ex, _ in pairs])
    assert torch.equal(adv[group % 2 == 1], torch.zeros(int((group % 2 == 1).sum())))  # constant: exactly 0
    if estimator == "mc_grpo":  # groups 0 and 2 keep their 4 non-pivot samples each; 1 and 3 nothing
        assert [int(keep[group == g].sum()) for g in range(4)] == [4, 0, 4, 0]
    else:  # groups 0 and 2 whole (grpo: the 0.5 sample, advantage 0; gdpo: group 0, its sum constant)
        assert keep.tolist() == (group % 2 == 0).tolist()
        assert float(adv[keep & (group == 0)].abs().min()) == 0.0


# G = 3, rewards 0.9 accuracy + 0.1 format (EasyR1's weights): accuracy all right with varied format; all wrong
# with equal format (a total of 0.1 inside the band); accuracy varied; everything right
_FILTER_GROUPS = (
    [[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]],
    [[0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]],
)


@pytest.mark.parametrize(
    "overrides, kept",
    [
        ([], [0, 2]),  # DAPO on the weighted sum: the groups whose totals vary
        (["trainer.dynamic_sampling_band=[0.01, 0.99]"], [0, 1, 2]),  # EasyR1 overall: means .967, .1, .4
        (["trainer.dynamic_sampling_key=exact_match"], [2]),  # DAPO on accuracy alone
        (["trainer.dynamic_sampling_key=exact_match", "trainer.dynamic_sampling_band=[0.01, 0.99]"], [2]),
    ],
)
def test_dynamic_sampling_key_and_band_choose_the_kept_groups(model_dir, tmp_path, overrides, kept):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "filter",
        "trainer.mode=group",
        "trainer.advantage=grpo",
        "trainer.dynamic_sampling=true",
        "rewards=[{name: exact_match, weight: 0.9}, {name: format, options: {}, weight: 0.1}]",
        *overrides,
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    trainer.score_samples = _scores_by_group(trainer, *_FILTER_GROUPS)
    pairs, _, keep, *_ = trainer.collect()
    group = torch.tensor([g for g, _ in _group_positions(pairs)])
    assert keep.tolist() == [g in kept for g in group.tolist()]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.dynamic_sampling_key=accuracy"],
            r"trainer.dynamic_sampling_key='accuracy' is not the key",
        ),
        (["trainer.dynamic_sampling_band=[0.9, 0.1]"], r"dynamic_sampling_band=\[0.9, 0.1\]: the low bound"),
        (
            ["trainer.dynamic_sampling=false", "trainer.dynamic_sampling_band=[0.01, 0.99]"],
            r"trainer.dynamic_sampling_band=\(0.01, 0.99\) chooses the groups DAPO's dynamic sampling keeps",
        ),
    ],
)
def test_dynamic_sampling_filter_settings_are_checked(model_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(model_dir, tmp_path, "f", "trainer.mode=group", "trainer.dynamic_sampling=true", *overrides)


def test_a_step_without_a_kept_sample_takes_no_optimizer_step_and_wakes_the_engine(model_dir, tmp_path):
    """Every group's rewards equal, dynamic sampling drops them all: the weights and the optimizer state stay as
    they were (zero gradients would still move them by Adam's momentum), and the generation backend gets the
    weights back (an engine asleep at level 2 discarded its own)."""
    cfg = make_cfg(model_dir, tmp_path, "nosignal", "trainer.mode=group", "trainer.dynamic_sampling=true")
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    trainer.score_samples = _scores_by_group(trainer, [[1, 0, 0]] * 4, [[1] * 3] * 4)
    trainer.update(*trainer.collect()[:4])  # one step that trains: Adam's momentum is not zero
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    optimizer_steps = [s["step"].clone() for s in trainer.optimizer.state.values()]
    assert optimizer_steps  # (the first step trained)
    synced = []
    trainer.backend.sync_weights = synced.append
    trainer.score_samples = _scores_by_group(trainer, [[1] * 3] * 4, [[1] * 3] * 4)
    pairs, adv, keep, lags, *_ = trainer.collect()
    assert not keep.any()
    trainer.update(pairs, adv, keep, lags)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert [s["step"] for s in trainer.optimizer.state.values()] == optimizer_steps
    assert synced == [trainer.model]
    assert trainer.metrics.reduce()["train/skipped_no_signal"] == 1.0


def test_dynamic_sampling_rounds_refill_the_step_with_varied_groups(model_dir, tmp_path):
    """DAPO's refill: 4 prompts a step, their groups varying in round 1 for one prompt, in round 2 for two and in
    round 3 for two: the step takes 3 rounds and keeps the first 4 varied groups, the last one dropped."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "refill",
        "trainer.mode=group",
        "trainer.advantage=grpo",
        "trainer.dynamic_sampling=true",
        "trainer.dynamic_sampling_rounds=4",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    varied_per_round = [{0}, {1, 2}, {0, 3}]
    calls: list[int] = []

    def fake_scores(pairs):
        varied = varied_per_round[len(calls)]
        calls.append(len(pairs))
        raw = torch.tensor([[float(g in varied and j == 0), 0.0] for g, j in _group_positions(pairs)])
        return raw @ trainer.reward_weights, raw, {}

    trainer.score_samples = fake_scores
    pairs, adv, keep, lags, *_ = trainer.collect()
    assert calls == [12, 12, 12]  # three rounds of 4 prompts x 3 samples, then enough
    assert len(pairs) == 36 and adv.shape == keep.shape == lags.shape == (36,)
    group_of_row = torch.arange(36) // 3  # rounds' groups in generation order: 4 per round
    kept_groups = sorted(set(group_of_row[keep].tolist()))
    assert kept_groups == [0, 5, 6, 8]  # round 1 group 0, round 2 groups 1-2, round 3 group 0; not group 3
    assert int(keep.sum()) == 12
    assert trainer.metrics.reduce()["dynamic_sampling/rounds"] == 3.0
    with pytest.raises(
        ValueError, match=r"trainer.dynamic_sampling_rounds=2 refills DAPO's dynamic sampling"
    ):
        make_cfg(model_dir, tmp_path, "refill1", "trainer.mode=group", "trainer.dynamic_sampling_rounds=2")


def test_a_verifier_used_twice_needs_labels_and_logs_under_each(model_dir, tmp_path):
    twice = "rewards=[{name: exact_match}, {name: exact_match, options: {number_words: true}, weight: 0.0}]"
    with pytest.raises(
        ValueError, match=r"several rewards log as \['exact_match'\]; give each a distinct `label`"
    ):
        make_cfg(model_dir, tmp_path, "r", twice)
    labelled = (
        "rewards=[{name: exact_match}, {name: exact_match, options: {number_words: true}, weight: 0.0, "
        "label: read}]"
    )
    trainer = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "r", labelled), None)
    trainer.setup(for_training=False)
    out = trainer.evaluate()
    assert {"eval/exact_match", "eval/read"} <= set(out)
    assert out["eval/read"] >= out["eval/exact_match"]


def test_cosine_learning_rate_follows_the_training_step(model_dir, tmp_path):
    cfg = make_cfg(model_dir, tmp_path, "cos", "trainer.steps=4", "trainer.lr_schedule=cosine")
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    seen = []
    for step in range(3):
        trainer.step = step
        trainer.train_step()
        seen.append(trainer.optimizer.param_groups[0]["lr"])
    # lr * (1 + cos(pi * step / steps)) / 2 at steps 0, 1, 2 of 4
    assert seen == pytest.approx([1e-2, 1e-2 * (1 + 2**-0.5) / 2, 1e-2 / 2], rel=1e-12)


def test_reasoning_steps_reward_reads_each_questions_reference_trace(tmp_path):
    """The generated shapes-math questions carry their reference traces to the rewards: the reference completion
    scores 1 on reasoning_steps, a trace with one wrong count less, one without a think span 0."""
    cfg = load_config(
        VLMRLVRConfig,
        "configs/demo/vlm_shapes_reason.yaml",
        [
            "run.progress=false",
            f"run.output_dir={tmp_path}",
            "data.train_limit=4",
            "data.eval_limit=4",
            "rewards=[{name: reasoning_steps, label: steps}]",
        ],
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup(for_training=False)
    item = make_math_items(1, cfg.run.seed, cfg.data.image_size, "train")[0]
    example = load_examples(cfg, "train")[0]
    assert example.reference == format_trace(item.steps) and example.answer == str(item.answer)
    first = item.steps[0]
    miscounted = format_completion((Step(first.label, first.value + 1), *item.steps[1:]), item.answer)
    texts = [item.completion, miscounted, f"<answer>{item.answer}</answer>"]
    pairs = [(example, SimpleNamespace(text=text)) for text in texts]  # verify reads a sample's text only
    _, raw = trainer.verify(pairs)
    assert raw[0, 0] == 1.0 and 0.0 < raw[1, 0] < 1.0 and raw[2, 0] == 0.0


def test_train_mix_adds_each_source_after_the_train_set():
    """``data.train_mix`` appends each source's examples (their own count, the run's seed) after ``data.train``'s;
    a source whose prompt ids repeat earlier ones is refused, naming the key."""
    overrides = ["run.progress=false", "data.train_limit=6", "data.train_mix={shapes_count:train: 3}"]
    cfg = load_config(VLMRLVRConfig, "configs/demo/vlm_shapes_reason.yaml", overrides)
    examples = load_examples(cfg, "train")
    assert [e.kind for e in examples[6:]] == ["count_all", "count_colour", "count_shape"]
    assert len({e.prompt_id for e in examples}) == 9
    counts = make_count_items(3, cfg.run.seed, cfg.data.image_size, "train")
    assert [(e.question, e.answer) for e in examples[6:]] == [(i.prompt, str(i.answer)) for i in counts]
    alone = load_config(VLMRLVRConfig, "configs/demo/vlm_shapes_reason.yaml", overrides[:2])
    assert [e.prompt_id for e in examples[:6]] == [e.prompt_id for e in load_examples(alone, "train")]
    repeated = load_config(
        VLMRLVRConfig,
        "configs/demo/vlm_shapes_reason.yaml",
        [*overrides[:2], "data.train_mix={shapes_math:train: 3}"],
    )
    with pytest.raises(ValueError, match=r"data.train_mix\['shapes_math:train'\] repeats prompt ids"):
        load_examples(repeated, "train")
    with pytest.raises(ValueError, match="train_mix"):
        load_config(
            VLMRLVRConfig, "configs/demo/vlm_shapes_reason.yaml", ["data.train_mix={shapes_count:train: 0}"]
        )


def test_reasoning_rl_from_the_committed_checkpoint_raises_lenient_heldout_accuracy():
    """The reasoning main job in miniature: from the demo's committed base (shapes-math SFT on traces half of which
    carry a teacher's slip), REASON_STEPS steps of the demo's recipe raise greedy held-out accuracy scored by the
    lenient check (answer span read as a number, number words accepted), the accuracy per well-formed completion
    rises too, so that answers newly put in their tags do not explain the gain, and the traces match their
    reference steps better. Measured: lenient 0.333 -> 0.496, format 1.0 -> 1.0, steps F1 0.234 -> 0.421."""
    cfg = load_config(
        VLMRLVRConfig,
        "configs/demo/vlm_shapes_reason.yaml",
        ["run.progress=false", f"trainer.steps={REASON_STEPS}", "data.eval_limit=252", "data.extra_eval={}"],
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    before = trainer.evaluate()
    for _ in range(cfg.trainer.steps):
        trainer.train_step()
        trainer.step += 1
    after = trainer.evaluate()
    print(
        {
            k: (before[k], after[k])
            for k in ("eval/lenient_accuracy", "eval/strict_accuracy", "eval/format_rate", "eval/steps_f1")
        }
    )
    assert after["eval/lenient_accuracy"] >= before["eval/lenient_accuracy"] + REASON_GAIN
    # not only answers newly put in their tags: accuracy per well-formed completion rises too
    per_formed = {
        k: r["eval/lenient_accuracy"] / r["eval/format_rate"] for k, r in (("b", before), ("a", after))
    }
    assert per_formed["a"] >= per_formed["b"] + REASON_GAIN / 2
    assert after["eval/lenient_accuracy"] >= after["eval/strict_accuracy"]
    # the trace states the steps the answer needs: the question's operators, the total count
    assert after["eval/steps_f1"] >= before["eval/steps_f1"] + REASON_GAIN


REASON_STEPS = 60
REASON_GAIN = 0.12


def test_prior_groups_kind_centres_each_questions_baseline_on_its_template(tmp_path):
    """``allocation.prior_groups: kind``: the baseline of a question not yet seen is the running mean of its
    template's rewards (shrunk to every reward's mean), so two unseen questions of different templates get
    different baselines; with the default (none) both get the global mean. Data without kinds are refused."""
    overrides = [
        "run.progress=false",
        f"run.output_dir={tmp_path}",
        "data.train_limit=40",
        "data.eval_limit=4",
        "allocation.prompts_per_step=8",
    ]
    grouped = VLMRLVRTrainer(
        load_config(
            VLMRLVRConfig, "configs/demo/vlm_shapes_reason.yaml", [*overrides, "allocation.prior_groups=kind"]
        ),
        None,
    )
    grouped.setup()
    by_kind: dict[str, list[str]] = {}
    for example in grouped.train_set:
        by_kind.setdefault(example.kind, []).append(example.prompt_id)
    (kind_a, ids_a), (kind_b, ids_b) = sorted(by_kind.items())[:2]
    assert len(ids_a) >= 2 and len(ids_b) >= 2 and kind_a != kind_b
    grouped.stats.update([ids_a[0], ids_b[0]], torch.tensor([1.0, 0.0]), step=0)
    k = grouped.cfg.allocation.prior_strength
    m = grouped.stats.global_mean()  # (1 + k / 2) / (2 + k) = 0.5
    expected = [(1.0 + k * m) / (1 + k), (0.0 + k * m) / (1 + k)]
    assert grouped.stats.success_prob([ids_a[1], ids_b[1]]).tolist() == pytest.approx(expected)
    plain = VLMRLVRTrainer(load_config(VLMRLVRConfig, "configs/demo/vlm_shapes_reason.yaml", overrides), None)
    plain.setup()
    plain.stats.update([ids_a[0], ids_b[0]], torch.tensor([1.0, 0.0]), step=0)
    assert plain.stats.success_prob([ids_a[1], ids_b[1]]).tolist() == pytest.approx([m, m])

    rows = [{"question": f"How many? ({n})", "answer": "2"} for n in range(8)]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(row) + "\n" for row in rows))
    no_kinds = load_config(
        VLMRLVRConfig,
        "configs/demo/vlm_shapes_reason.yaml",
        [
            *overrides,
            f"data.train={questions}",
            f"data.eval={questions}",
            "data.image_column=null",
            "data.extra_eval={}",
            "rewards=[{name: numeric}]",
            "eval_rewards=[]",
            "trainer.process_credit.reward=null",
            "allocation.prior_groups=kind",
        ],
    )
    with pytest.raises(ValueError, match=r"allocation.prior_groups: kind .* have none"):
        VLMRLVRTrainer(no_kinds, None).setup()


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_minibatches_give_the_gradient_of_one_full_batch(model_dir, tmp_path, loss_agg):
    """17 kept rows of 1 to 6 tokens, cut 16 + 1 by ``trainer.minibatch_size=16``, give the gradient of one
    17-row batch (``minibatch_size=64``) under every ``loss_agg``: each minibatch's loss weighs its share of the
    step (its tokens for token_mean, its rows for the row-averaged modes), not 1 / number of minibatches."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "agg",
        "trainer.mode=group",
        "allocation.prompts_per_step=6",
        "trainer.minibatch_size=16",
        f"trainer.loss_agg={loss_agg}",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    pairs, *_ = trainer.collect()
    assert len(pairs) == 18
    # completions of 1..6 tokens: the rows' token counts differ, so token and row shares differ
    pairs = [
        (
            example,
            dataclasses.replace(
                sample,
                completion_token_ids=sample.completion_token_ids[: 1 + row % 6],
                logprobs=sample.logprobs[: 1 + row % 6],
            ),
        )
        for row, (example, sample) in enumerate(pairs)
    ]
    assert len({len(sample.completion_token_ids) for _, sample in pairs}) == 6
    keep = torch.ones(len(pairs), dtype=torch.bool)
    keep[4] = False
    adv = torch.randn(len(pairs), generator=torch.Generator().manual_seed(0))
    grads: list[list[torch.Tensor]] = []

    def record(optimizer, params, max_grad_norm, lr=None):
        grads.append([param.grad.clone() for param in params])
        optimizer.zero_grad(set_to_none=True)

    trainer.optimizer_step = record
    trainer.update(pairs, adv, keep)
    trainer.cfg.trainer.minibatch_size = 64
    trainer.update(pairs, adv, keep)
    chunked, full = grads
    assert any(bool(grad.abs().max() > 1e-3) for grad in full)
    for chunked_grad, full_grad in zip(chunked, full, strict=True):
        torch.testing.assert_close(chunked_grad, full_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["full", "sampled"])
def test_entropy_mean_is_the_policys_entropy_whatever_the_shaping_reads(model_dir, tmp_path, kind):
    """``entropy/mean`` is the full-vocabulary entropy of the old policy on the completion tokens under either
    shaping kind (sampled shaping logged the sampled token's -p log p there: 0.013 where the entropy is 6.07);
    what sampled shaping reads is logged as ``entropy/sampled_term_mean``."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "entropy",
        "trainer.mode=group",
        "trainer.minibatch_size=64",  # one minibatch: its masked means are the batch's
        f"trainer.entropy_shaping.kind={kind}",
    )
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    pairs, *_ = trainer.collect()
    with torch.no_grad():
        stats = trainer.token_stats(pairs, cfg.generation.temperature)
    tokens = stats.mask.sum()
    entropy = float((stats.entropy * stats.mask).sum() / tokens)
    sampled = float((stats.sampled_entropy * stats.mask).sum() / tokens)
    # random weights: the entropy is near log(vocabulary), and -p log p of a token of p ~ 1/V is tiny
    assert entropy > 5.0 > 0.1 > sampled
    adv = torch.randn(len(pairs), generator=torch.Generator().manual_seed(0))
    trainer.update(pairs, adv, torch.ones(len(pairs), dtype=torch.bool))
    metrics = trainer.metrics.reduce()
    assert metrics["entropy/mean"] == pytest.approx(entropy, rel=1e-5)
    if kind == "sampled":
        assert metrics["entropy/sampled_term_mean"] == pytest.approx(sampled, rel=1e-5)
    else:
        assert "entropy/sampled_term_mean" not in metrics


class RecordingBackend(GenerationBackend):
    """The trainer's transformers backend, recording the engine calls a vLLM engine would get."""

    def __init__(self, inner: GenerationBackend, calls: list[str]) -> None:
        super().__init__()
        self.inner = inner
        self.calls = calls
        self.suppressed_token_ids = inner.suppressed_token_ids

    def generate(self, prompts, params):
        self.calls.append("generate")
        return self.inner.generate(prompts, params)

    def _load_weights(self, model):
        self.calls.append("sync")  # (VLLMBackend wakes the engine here)
        self.inner._load_weights(model)

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")


def test_the_rollout_engine_sleeps_after_generation_and_evaluation(model_dir, tmp_path):
    """A step generates, puts the engine to sleep, trains, then syncs the weights (which wakes a vLLM engine)
    before the next step generates; evaluation sleeps once its answers are generated."""
    trainer = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "sleep", "trainer.beta=0"), None)
    trainer.setup()
    calls: list[str] = []
    trainer.backend = RecordingBackend(trainer.backend, calls)
    scored = trainer.score_samples
    trainer.score_samples = lambda pairs: (torch.arange(len(pairs)) % 2.0, *scored(pairs)[1:])
    token_stats = trainer.token_stats

    def training(batch, temperature, model=None):
        calls.append("train")
        return token_stats(batch, temperature, model)

    trainer.token_stats = training
    trainer.train_step()
    trainer.step += 1
    trainer.collect()
    trainer.evaluate()
    assert calls == ["generate", "sleep", "train", "sync", "generate", "sleep", "generate", "sleep"]


def test_evaluation_samples_at_eval_temperature_and_is_greedy_by_default(model_dir, tmp_path):
    """EasyR1 validates by sampling (temperature 0.6, top_p 0.95): the held-out answers are drawn with the eval
    settings, not the rollouts' (temperature 1, top_p 1), and greedy (temperature 0, top_p 1) by default."""
    seen: list[tuple[float, float, int]] = []

    def run(name, *overrides):
        trainer = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, name, *overrides), None)
        trainer.setup()
        generate = trainer.backend.generate

        def recording(prompts, params):
            seen.append((params.temperature, params.top_p, params.n))
            return generate(prompts, params)

        trainer.backend.generate = recording
        trainer.evaluate()
        return [sample.text for _, sample in trainer._last_eval[0]]

    greedy = run("greedy")
    assert seen == [(0.0, 1.0, 1)] and run("greedy2") == greedy  # greedy answers repeat
    seen.clear()
    sampled = run("sampled", "generation.eval_temperature=0.6", "generation.eval_top_p=0.95")
    assert seen == [(0.6, 0.95, 1)]
    assert sampled != greedy


def test_a_step_whose_every_prompt_is_too_long_names_the_length_settings(model_dir, tmp_path):
    trainer = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "long", "generation.max_prompt_length=8"), None)
    trainer.setup()
    with pytest.raises(ValueError) as error:
        trainer.collect()
    assert str(error.value) == (
        "generation.max_prompt_length (8), generation.max_model_len (null): all 4 prompts of step 0 are too long "
        "for them (each one's length is in the warnings above); raise them or filter the data"
    )


def test_skipped_prompts_are_counted_per_step_and_per_evaluation(model_dir, tmp_path):
    """The backend skips the first prompt of every call: a step of four prompts in two generate calls (group
    sizes 2 and 3) logs ``gen/skipped`` 2, its total, and trains on the rest; an evaluation of 8 questions in one
    call reports ``eval/skipped`` 1 and leaves nothing in the next step's metrics."""
    from dataclasses import replace

    from pipelines.vlm.inputs import SkippedPrompt

    trainer = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "skips", "trainer.mode=group"), None)
    trainer.setup()
    real = trainer.backend.generate

    def generate_skipping_first(prompts, params):
        result = real(prompts, params)
        kept = [sample for sample in result.samples if sample.prompt_index != 0]
        return replace(result, samples=kept, skipped=[SkippedPrompt(0, prompts[0].prompt_id, "too long")])

    trainer.backend.generate = generate_skipping_first
    ids = [ex.prompt_id for ex in trainer.train_set[:4]]
    trainer.choose_prompts = lambda k, exclude=frozenset(): (ids, [2, 3, 3, 2])
    batch = (
        trainer.collect()
    )  # calls [ids[0], ids[3]] x 2 and [ids[1], ids[2]] x 3: ids[0] and ids[1] skipped
    assert [ex.prompt_id for ex, _ in batch.pairs] == [ids[3]] * 2 + [ids[2]] * 3
    assert trainer.metrics.reduce()["gen/skipped"] == 2.0
    assert trainer.evaluate()["eval/skipped"] == 1.0
    assert "gen/skipped" not in trainer.metrics.reduce()


def test_evaluation_leaves_training_as_it_was_and_samples_the_same_answers_each_time(model_dir, tmp_path):
    """An evaluation draws nothing from the training generator (a run evaluating more often trains on the same
    prompts and samples), and sampled evaluations repeat their answers (one seed at every evaluation)."""
    overrides = ("trainer.mode=group", "generation.eval_temperature=0.8")
    evaluated = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "evaluated", *overrides), None)
    plain = VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "plain", *overrides), None)
    evaluated.setup()
    plain.setup()
    evaluated.evaluate()
    first = [sample.text for _, sample in evaluated._last_eval[0]]
    evaluated.evaluate()
    assert [sample.text for _, sample in evaluated._last_eval[0]] == first
    ours, theirs = evaluated.collect(), plain.collect()
    assert [(ex.prompt_id, s.text) for ex, s in ours.pairs] == [
        (ex.prompt_id, s.text) for ex, s in theirs.pairs
    ]


def test_a_steps_sample_file_shows_the_rewards_it_trained_on(model_dir, tmp_path):
    """The verifiers score a step once: the sample file shows those rewards (a judge or a remote reward asked
    again could answer otherwise), whatever a later call would return."""
    from mmrl.run import Run

    cfg = make_cfg(model_dir, tmp_path, "shown", "trainer.mode=group", "trainer.sample_every=1")
    trainer = VLMRLVRTrainer(cfg, Run(cfg.run, cfg))
    trainer.setup()
    calls = []

    def scores(pairs):
        calls.append(len(pairs))
        raw = torch.tensor([[float(len(calls)), 0.5]] * len(pairs))
        return raw @ trainer.reward_weights, raw, {}

    trainer.score_samples = scores
    trainer.train_step()
    assert calls == [12]  # (4 prompts x 3), scored once
    records = [json.loads(line) for line in (tmp_path / "shown/samples/train_00000001.jsonl").open()]
    assert [(r["exact_match"], r["format"]) for r in records] == [(1.0, 0.5)] * 8


def test_tis_auto_weights_samples_drawn_from_a_top_p_nucleus(model_dir, tmp_path):
    """``trainer.tis: auto`` is on for the transformers backend once ``generation.top_p < 1`` (the behaviour
    log-probs are then those of the truncated nucleus): lag-0 samples get the truncated importance weights."""

    def trainer(*overrides: str) -> VLMRLVRTrainer:
        return VLMRLVRTrainer(make_cfg(model_dir, tmp_path, "tis", *overrides), None)

    assert not trainer().uses_tis
    assert not trainer("generation.top_p=0.9", 'trainer.tis="off"').uses_tis
    nucleus = trainer("generation.top_p=0.9")
    assert nucleus.uses_tis
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
    behaviour = torch.full((2, 3), -1.5)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights = nucleus.loss_weights(old, behaviour, mask, torch.zeros(2, dtype=torch.long))
    # min(exp(old - behaviour), tis_cap = 2) per completion token, 0 on padding
    torch.testing.assert_close(
        weights, torch.tensor([[1.6487, 0.6065, 2.0], [0.2231, 1.6487, 0.0]]), atol=1e-4, rtol=0
    )


def test_vlm_eval_refuses_more_than_one_answer_per_question(model_dir, tmp_path, capsys):
    """VLM evaluation answers each question once, greedily: ``images_per_prompt`` (``mmrl eval
    --images-per-prompt``) other than 1 is refused, by ``evaluate`` and by the CLI (exit status 2)."""
    message = (
        "--images-per-prompt 3: a vlm_rlvr run is evaluated with one greedy answer per question (N greedy answers "
        "would be the same answer); leave the flag out"
    )
    with pytest.raises(ValueError) as error:
        evaluate(make_cfg(model_dir, tmp_path, "ev"), None, tmp_path / "eval", None, 3)
    assert str(error.value) == message
    config = CONFIGS / "demo" / "vlm_shapes_single.yaml"
    out = tmp_path / "cli_eval"
    assert cli_main(["eval", str(config), "--images-per-prompt", "3", "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"mmrl: error: {message}\n"
    assert not out.exists()


def test_a_reward_that_needs_what_a_vlm_run_does_not_give_is_refused_when_the_config_loads(
    model_dir, tmp_path
):
    from mmrl.vlm.config import REWARD_FIELDS

    assert tuple(VLMRLVRTrainer._reward_batch([])) == REWARD_FIELDS  # what the check assumes is what is sent
    for key in ("rewards", "eval_rewards"):
        with pytest.raises(
            ValueError,
            match=rf"{key}\.0: the 'shapes' reward scores \['images', 'prompts'\], and a vlm_rlvr run gives each "
            r"reward \['completions', 'ground_truths', 'references'\]",
        ):
            make_cfg(model_dir, tmp_path, "img", f"{key}=[{{name: shapes}}]")
    make_cfg(model_dir, tmp_path, "ok", "eval_rewards=[{name: remote, options: {url: 'http://127.0.0.1:1'}}]")
