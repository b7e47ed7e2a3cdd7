"""Process credit: a reward's step scores become token advantages on the tokens that wrote each step."""

from types import SimpleNamespace

import pytest
import torch

import rewards
from mmrl.config import load_config
from mmrl.core import advantages as adv_lib
from mmrl.data.shapes_math import make_math_items
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.process_credit import process_advantages, token_char_ends
from mmrl.vlm.trainer import VLMRLVRTrainer
from rewards.base import StepScore

DEMO = "configs/demo/vlm_shapes_reason.yaml"


def demo_cfg(tmp_path, *overrides):
    return load_config(
        VLMRLVRConfig,
        DEMO,
        [
            "run.progress=false",
            "run.tensorboard=false",
            f"run.output_dir={tmp_path}",
            "data.train_limit=16",
            "data.eval_limit=4",
            "data.extra_eval={}",
            "allocation.prompts_per_step=8",
            "trainer.minibatch_size=8",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    trainer = VLMRLVRTrainer(demo_cfg(tmp_path_factory.mktemp("tok")), None)
    trainer.setup(for_training=False)
    return trainer.processor.tokenizer


def test_token_char_ends_follow_the_decoded_text(tokenizer):
    text = "<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ends = token_char_ends(tokenizer, ids)
    assert len(ends) == len(ids) and ends[-1] == len(text) == ends[-2]  # the stop token writes nothing
    assert ends == sorted(ends)
    pieces = [text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    assert "".join(pieces) == text


def test_windowed_ends_equal_the_ends_of_every_decoded_prefix(tokenizer):
    """Decoding each token with a few tokens of context gives the same ends as decoding every prefix (the O(T^2)
    definition), on real completions and on text with multi-byte characters."""
    texts = [item.completion for item in make_math_items(12, 3, 64, "train")]
    texts += ["<think>grün 2. ünd 3–1=2 ✓</think><answer>2</answer>", "  two  spaces. then\nnew line"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        prefix_ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
        for context in (3, 8):  # a UTF-8 character spans at most 4 byte-level tokens
            assert token_char_ends(tokenizer, ids, context=context) == prefix_ends


def test_each_step_is_credited_on_the_tokens_that_wrote_it(tokenizer):
    """The committed checkpoint's tokenizer on real shapes-math completions: every scored step lands on the tokens
    whose text holds it, and the advantages are the core's process_supervised of those spans."""
    items = make_math_items(6, 0, 64, "train")
    texts = [item.completion for item in items]
    # one wrong count in the second completion, so the step scores differ
    texts[1] = texts[1].replace(f"{items[1].steps[0].value}.", f"{items[1].steps[0].value + 1}.", 1)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    scored = rewards.build("reasoning_steps").score(
        completions=texts, references=[i.completion.split("<think>")[1].split("</think>")[0] for i in items]
    )
    width = max(map(len, ids))
    adv, metrics = process_advantages(
        tokenizer, list(zip(ids, texts, strict=True)), scored.steps, None, width, credit="step"
    )
    assert metrics["process/unaligned_frac"] == 0.0
    assert metrics["process/steps_per_sample"] == sum(map(len, scored.steps)) / len(texts)
    rows, first, last, values = [], [], [], []
    for row, (token_ids, text, steps) in enumerate(zip(ids, texts, scored.steps, strict=True)):
        ends = token_char_ends(tokenizer, token_ids)
        starts = [0, *ends[:-1]]
        for step in steps:
            covered = [k for k in range(len(token_ids)) if starts[k] < step.end and ends[k] > step.start]
            assert text[step.start : step.end] in tokenizer.decode(token_ids[covered[0] : covered[-1] + 1])
            rows.append(row)
            first.append(covered[0])
            last.append(covered[-1])
            values.append(step.score)
    assert 0.0 in values and 1.0 in values
    expected = adv_lib.process_supervised(
        torch.tensor(values),
        torch.tensor(rows),
        torch.tensor(first),
        torch.tensor(last),
        torch.zeros(len(values), dtype=torch.long),
        len(texts),
        width,
        credit="step",
    )
    torch.testing.assert_close(adv, expected)
    # the miscounted step pulls its own tokens down and nobody else's
    wrong = next(s for s in scored.steps[1] if s.score == 0.0)
    ends = token_char_ends(tokenizer, ids[1])
    assert adv[1, next(k for k, e in enumerate(ends) if e >= wrong.end)] < 0


def test_text_that_is_not_the_tokens_decoded_gets_no_step_credit(tokenizer):
    ids = tokenizer("<think>red 2</think>", add_special_tokens=False)["input_ids"]
    steps = [[StepScore(7, 12, 1.0)], [StepScore(7, 12, 0.0)]]
    adv, metrics = process_advantages(
        tokenizer, [(ids, "<think>red 2</think>"), (ids, "<think>red 2</think> extra")], steps, None, len(ids)
    )
    assert metrics["process/unaligned_frac"] == 0.5
    assert adv[1].abs().max() == 0  # the unaligned row: nothing
    assert adv[0].abs().max() == 0  # one step left in the batch: normalised to 0


def test_process_credit_config_names_its_reward(tmp_path):
    with pytest.raises(ValueError, match=r"process_credit.reward='answer_steps' is not the key of a reward"):
        demo_cfg(tmp_path, "trainer.process_credit.reward=answer_steps")
    trainer = VLMRLVRTrainer(demo_cfg(tmp_path, "trainer.process_credit.reward=format"), None)
    with pytest.raises(ValueError, match=r"process_credit.reward='format'.*scores whole completions"):
        trainer.setup(for_training=False)


def test_collect_adds_step_advantages_to_the_sequence_advantage(tmp_path):
    trainer = VLMRLVRTrainer(demo_cfg(tmp_path, "trainer.process_credit.reward=steps"), None)
    trainer.setup()
    torch.manual_seed(0)
    pairs, adv, keep, *_ = trainer.collect()
    widths = [len(s.completion_token_ids) for _, s in pairs]
    assert adv.shape == (len(pairs), max(widths))
    # past a completion's last step (its answer) only the sequence advantage is left: the same on every such token
    last = adv[:, -1:]
    for row, width in enumerate(widths):
        if width == max(widths):
            assert adv[row, -1] == last[row, 0]
    assert any(len(set(adv[row, :w].tolist())) > 1 for row, w in enumerate(widths))
    metrics = trainer.metrics.reduce()
    assert metrics["process/unaligned_frac"] == 0.0 and metrics["process/steps_per_sample"] > 1
    trainer.update(pairs, adv, keep)  # token advantages train as sequence ones do


def test_equal_token_advantages_train_as_the_sequence_advantage(tmp_path):
    """An [N, T] advantage that is the same on every token gives the update of the [N] advantage (to rounding)."""
    results = []
    for token_level in (False, True):
        trainer = VLMRLVRTrainer(demo_cfg(tmp_path, f"run.name=eq{token_level}", "trainer.beta=0"), None)
        trainer.setup()
        torch.manual_seed(0)
        pairs, _, keep, *_ = trainer.collect()
        adv = torch.linspace(-1, 1, len(pairs))
        if token_level:  # wider than any completion: cut to each minibatch's width
            adv = adv[:, None].expand(-1, 60).clone()
        trainer.update(pairs, adv, keep)
        results.append([p.detach().clone() for p in trainer.trainable])
    for seq, tok in zip(*results, strict=True):
        torch.testing.assert_close(seq, tok, atol=1e-6, rtol=1e-5)


def test_position_normalisation_compares_the_kth_steps_of_the_completions(tokenizer):
    """Two completions whose first steps are both right and whose second steps differ: normalised over all steps
    the right first steps are credited; by position they are not (nothing tells them apart), and the second steps
    get +1 and -1."""
    text = "<think>red 2. blue 1</think>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    first, second = StepScore(7, 12, 1.0), (StepScore(14, 20, 1.0), StepScore(14, 20, 0.0))
    steps = [[first, second[0]], [first, second[1]]]
    ends = token_char_ends(tokenizer, ids)
    at_red = next(k for k, e in enumerate(ends) if e > 7)
    at_blue = next(k for k, e in enumerate(ends) if e > 14)
    by_position, _ = process_advantages(
        tokenizer, [(ids, text)] * 2, steps, None, len(ids), credit="step", normalize="position"
    )
    over_all, _ = process_advantages(tokenizer, [(ids, text)] * 2, steps, None, len(ids), credit="step")
    assert by_position[:, at_red].tolist() == [0.0, 0.0]
    assert by_position[:, at_blue].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    # over all four steps (mean 3/4): a right step 1/sqrt(3), the wrong one -sqrt(3)
    assert over_all[:, at_red].tolist() == pytest.approx([3**-0.5] * 2, abs=1e-5)
    assert over_all[:, at_blue].tolist() == pytest.approx([3**-0.5, -(3**0.5)], abs=1e-5)
    with pytest.raises(ValueError, match="normalize must be"):
        process_advantages(tokenizer, [(ids, text)], steps[:1], None, len(ids), normalize="kind")


def test_single_rollout_steps_can_be_normalised_within_a_question_kind(tmp_path):
    """``single_groups: kind`` groups a single-rollout batch's steps by their questions' kind (the shapes_math
    template), in order of first appearance; ``batch`` (the default) normalises over the whole batch; group mode
    keeps its prompt groups."""
    kinds = ["remove_colour", "add_shape", "remove_colour", "compare_shapes"]
    pairs = [(SimpleNamespace(kind=kind), None) for kind in kinds]
    prompt_groups = torch.tensor([0, 0, 1, 1])
    by_kind = VLMRLVRTrainer(demo_cfg(tmp_path, "trainer.process_credit.single_groups=kind"), None)
    assert by_kind._step_groups(pairs, prompt_groups).tolist() == [0, 1, 0, 2]
    assert VLMRLVRTrainer(demo_cfg(tmp_path), None)._step_groups(pairs, prompt_groups) is None
    group = VLMRLVRTrainer(demo_cfg(tmp_path, "trainer.mode=group", "trainer.num_generations=2"), None)
    assert group._step_groups(pairs, prompt_groups) is prompt_groups
