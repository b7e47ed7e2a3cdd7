"""Bad input ends in one clear error naming the file, row or key: VQA files, prompt files against a reward's
grammar, configs that are not UTF-8, rewards that raise or return NaN, the CLI's one-line errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

import rewards
from mmrl.cli import main as cli_main
from mmrl.config import ConfigError, load_config, load_yaml
from mmrl.data.prompts import check_prompts, load_prompts
from mmrl.data.vqa import check_answers, load_vqa
from rewards.base import Reward, RewardCheckError, RewardOutput, checked_score
from rewards.shapes import MAX_PROMPT_CHARS, ShapesReward


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("missing", ["question", "answer"])
@pytest.mark.parametrize("value", [None, "  "])
def test_vqa_row_without_question_or_answer_is_named(tmp_path, missing, value) -> None:
    rows = [{"question": "how many?", "answer": "2"}, {"question": "what colour?", "answer": "red"}]
    rows[1][missing] = value
    source = write_jsonl(tmp_path / "vqa.jsonl", rows)
    with pytest.raises(ValueError, match=rf"vqa\.jsonl row 1: no '{missing}'"):
        load_vqa(source, image_column=None)


def test_vqa_rows_load_when_complete(tmp_path) -> None:
    source = write_jsonl(tmp_path / "vqa.jsonl", [{"question": "how many?", "answer": 2}])
    [example] = load_vqa(source, image_column=None, question_template="Q: {question}")
    assert (example.question, example.answer, example.prompt_id) == ("Q: how many?", "2", "vqa-0")


def test_numbers_of_a_column_that_mixes_integers_and_decimals_keep_their_integers(tmp_path) -> None:
    """JSON answers 4 and 2.5 load as one float column; the answer 4 stays "4" (exact match against "4.0"
    would fail every right integer answer), and so do integer ids."""
    import rewards

    source = tmp_path / "mixed.jsonl"
    rows = [
        {"id": 7, "question": "how many?", "answer": 4},
        {"id": 8.5, "question": "how much?", "answer": 2.5},
    ]
    source.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    examples = load_vqa(str(source), image_column=None, id_column="id")
    assert [(ex.prompt_id, ex.answer) for ex in examples] == [("7", "4"), ("8.5", "2.5")]
    exact = rewards.build("exact_match")
    assert (
        exact.score(completions=["<answer>4</answer>"], ground_truths=[examples[0].answer]).scores.item()
        == 1.0
    )


def test_vqa_question_template_with_a_literal_brace_names_the_key_and_the_field(tmp_path) -> None:
    source = write_jsonl(tmp_path / "vqa.jsonl", [{"question": "how many?", "answer": 2}])
    template = 'Reply as {"answer": N}. {question}'
    with pytest.raises(ValueError) as error:
        load_vqa(source, image_column=None, question_template=template)
    assert str(error.value) == (
        f'data.question_template {template!r}: unknown field {{"answer"}}; its only field is {{question}}, '
        "and a literal brace is written doubled ({{ or }})"
    )
    with pytest.raises(
        ValueError, match=r"data\.question_template '\{question\} \{': Single '\{' encountered"
    ):
        load_vqa(source, image_column=None, question_template="{question} {")
    doubled = load_vqa(source, image_column=None, question_template='Reply as {{"answer": N}}. {question}')
    assert doubled[0].question == 'Reply as {"answer": N}. how many?'


def test_vqa_reference_column_is_read_and_a_missing_reference_named(tmp_path) -> None:
    rows = [
        {"question": "2+2?", "answer": "4", "steps": "2+2=4"},
        {"question": "3-1?", "answer": "2", "steps": ""},
    ]
    source = write_jsonl(tmp_path / "steps.jsonl", rows)
    assert load_vqa(source, image_column=None)[0].reference == ""
    assert load_vqa(source, image_column=None, reference_column="steps", limit=1)[0].reference == "2+2=4"
    with pytest.raises(ValueError, match=r"steps\.jsonl row 1: no 'steps'.*reference solution"):
        load_vqa(source, image_column=None, reference_column="steps")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['solution'\]"):
        load_vqa(source, image_column=None, reference_column="solution")
    # a reward that reads reference solutions refuses questions without one before any rollout
    with pytest.raises(
        ValueError, match=r"steps\.jsonl row 0 \(id steps-0\): no reference solution.*'steps'"
    ):
        check_answers(
            load_vqa(source, image_column=None), [("steps", rewards.build("reasoning_steps"))], source
        )


def test_vqa_answer_that_is_no_number_for_a_numeric_verifier_is_named(tmp_path) -> None:
    rows = [{"question": "how many?", "answer": "2"}, {"question": "how many?", "answer": "two"}]
    rows.append({"question": "how many?", "answer": "many"})
    source = write_jsonl(tmp_path / "math.jsonl", rows)
    examples = load_vqa(source, image_column=None)
    check_answers(examples, [("exact", rewards.build("exact_match"))], source)  # any answer is fine there
    check_answers(examples[:2], [("answer", rewards.build("numeric", number_words=True))], source)
    with pytest.raises(
        ValueError, match=r"math\.jsonl row 1 \(id math-1\): answer 'two' is not a number.*'answer'"
    ):
        check_answers(examples, [("answer", rewards.build("numeric"))], source)
    with pytest.raises(ValueError, match=r"row 2 \(id math-2\): answer 'many' is not a number"):
        check_answers(examples, [("answer", rewards.build("numeric", number_words=True))], source)


@pytest.mark.parametrize(
    ("reward", "answers", "problem"),
    [
        ("multiple_choice", ["(B) red", "red"], 'names no option letter (as B, (B), A,C or "(B) red" do)'),
        ("math_verify", ["\\frac{1}{2}", "\\boxed{}"], "does not parse as math"),
    ],
)
def test_vqa_answer_a_choice_or_math_verifier_cannot_read_is_named(
    tmp_path, reward, answers, problem
) -> None:
    rows = [{"question": "which?", "answer": answer} for answer in answers]
    source = write_jsonl(tmp_path / "q.jsonl", rows)
    examples = load_vqa(source, image_column=None)
    check_answers(examples[:1], [("answer", rewards.build(reward))], source)
    with pytest.raises(ValueError) as error:
        check_answers(examples, [("answer", rewards.build(reward))], source)
    assert str(error.value).startswith(f"{source} row 1 (id q-1): answer {answers[1]!r} {problem}")
    assert str(error.value).endswith("which the reward 'answer' needs")


def test_vqa_row_without_an_image_is_named(tmp_path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [
        {"question": "q", "answer": "1", "image": "a.png"},
        {"question": "q", "answer": "1", "image": None},
    ]
    source = write_jsonl(tmp_path / "vqa.jsonl", rows)
    with pytest.raises(ValueError, match=r"vqa\.jsonl row 1: no image in column 'image'"):
        load_vqa(source)
    assert len(load_vqa(source, limit=1)[0].images) == 1


def test_a_16_bit_image_in_vqa_data_is_scaled_not_clipped(tmp_path) -> None:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16)).save(tmp_path / "grey16.png")  # mid grey
    source = write_jsonl(tmp_path / "vqa.jsonl", [{"question": "q", "answer": "1", "image": "grey16.png"}])
    [example] = load_vqa(source)
    assert example.images[0].getpixel((0, 0)) == (128, 128, 128)  # convert("RGB") alone gives white


def test_a_null_inside_an_image_list_is_named_not_dropped(tmp_path) -> None:
    from PIL import Image

    for name in ("a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(tmp_path / name)
    rows = [{"question": "q", "answer": "1", "image": ["a.png", None, "b.png"]}]
    source = write_jsonl(tmp_path / "vqa.jsonl", rows)
    with pytest.raises(ValueError, match=r"vqa\.jsonl row 0: image 1 of the list in column 'image' is null"):
        load_vqa(source)


def test_parquet_images_resolve_against_the_file_and_a_bad_one_names_its_row(tmp_path, monkeypatch) -> None:
    import datasets
    from PIL import Image

    (tmp_path / "img").mkdir()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "img/a.png")
    features = datasets.Features(
        {"question": datasets.Value("string"), "answer": datasets.Value("string"), "image": datasets.Image()}
    )
    rows = {"question": ["q0", "q1"], "answer": ["1", "2"], "image": ["img/a.png", "img/a.png"]}
    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "vqa.parquet")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the relative image paths are the file's, not the working directory's
    examples = load_vqa(str(tmp_path / "vqa.parquet"))
    assert [ex.images[0].getpixel((0, 0)) for ex in examples] == [(200, 10, 10)] * 2
    broken = {
        "question": ["q0", "q1"],
        "answer": ["1", "2"],
        "image": [{"bytes": b"not a png", "path": None}] * 2,
    }
    datasets.Dataset.from_dict(broken, features=features).to_parquet(tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet row 0: cannot read image"):
        load_vqa(str(tmp_path / "broken.parquet"))


def test_a_hub_source_names_its_split_and_eval_may_not_read_the_training_split(monkeypatch) -> None:
    from mmrl.data.vqa import hub_source
    from mmrl.vlm.config import VLMRLVRConfig

    assert hub_source("org/geo@test", "train") == ("org/geo", "test")
    assert hub_source("org/geo", "train") == ("org/geo", "train")
    asked = []
    monkeypatch.setattr(
        "mmrl.data.vqa._load_dataset", lambda source, *args, **kw: asked.append((args, kw)) or 1 / 0
    )
    with pytest.raises(ZeroDivisionError):
        load_vqa("org/geo@validation")
    assert asked == [(("org/geo",), {"split": "validation"})]
    for train, held_out in (
        ("org/geo", "org/geo"),
        ("org/geo", "org/geo@train"),
        ("org/geo@test", "org/geo@test"),
    ):
        with pytest.raises(ValueError, match=r"data\.eval: .* as data\.train does"):
            load_config(VLMRLVRConfig, None, [f"data.train={train}", f"data.eval={held_out}"])
    load_config(VLMRLVRConfig, None, ["data.train=org/geo", "data.eval=org/geo@test"])


def test_malformed_empty_and_unsupported_vqa_files_are_named(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "q2", "answer": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl cannot be read: line 2 is not valid JSON"):
        load_vqa(str(bad), image_column=None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl is empty"):
        load_vqa(str(empty), image_column=None)
    csv = tmp_path / "data.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported format"):
        load_vqa(str(csv))


def test_unreachable_hub_dataset_is_named(monkeypatch) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"cannot load the hub dataset 'someorg/vqa-set'.*local \.json"):
        load_vqa("someorg/vqa-set")


def test_prompt_file_is_checked_against_the_grammar_with_its_line(tmp_path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("# eval prompts\na photo of a red circle\n\na photo of a green dragon\n")
    prompts = load_prompts(str(path))
    with pytest.raises(
        ValueError, match=r"prompts\.txt line 4: cannot parse shapes prompt 'a photo of a green dragon'"
    ):
        check_prompts(str(path), prompts, [ShapesReward()])
    check_prompts(str(path), prompts, [Reward()])  # a reward without a grammar accepts every prompt
    check_prompts("shapes:heldout", load_prompts("shapes:heldout"), [ShapesReward()])


def test_a_byte_order_mark_is_not_read_as_prompt_text(tmp_path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("# my prompts\na photo of a red circle\n", encoding="utf-8-sig")
    assert load_prompts(str(path)) == ["a photo of a red circle"]


def test_a_megabyte_prompt_line_is_refused_at_once(tmp_path) -> None:
    path = tmp_path / "huge.txt"
    path.write_text("a photo of a red circle\na photo of " + "x" * 9_600_000 + "\n")
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        check_prompts(str(path), load_prompts(str(path)), [ShapesReward()])
    assert time.monotonic() - start < 5.0
    message = str(error.value)
    assert (
        "huge.txt line 2" in message
        and f"at most {MAX_PROMPT_CHARS} characters" in message
        and len(message) < 400
    )


class ScriptedReward(Reward):
    """Returns the scores it is given, or raises them if they are an exception."""

    def __init__(self, result: list[float] | Exception) -> None:
        self.result = result

    def score(self, **batch) -> RewardOutput:
        if isinstance(self.result, Exception):
            raise self.result
        return RewardOutput(scores=torch.tensor(self.result))


def test_checked_score_names_the_reward_and_the_first_bad_sample() -> None:
    prompts = ["p0", "p1", "p2"]
    out = checked_score(ScriptedReward([0.0, 1.0, 0.5]), "ok", 3, prompts=prompts)
    assert out.scores.tolist() == [0.0, 1.0, 0.5]
    with pytest.raises(
        RewardCheckError,
        match=r"'clip' returned 2 non-finite score\(s\) of 3; the first is nan at sample 1 \(prompt 'p1'\)",
    ):
        checked_score(ScriptedReward([0.0, float("nan"), float("inf")]), "clip", 3, prompts=prompts)
    with pytest.raises(RewardCheckError, match=r"'clip' returned scores of shape \(2,\) for 3 samples"):
        checked_score(ScriptedReward([0.0, 1.0]), "clip", 3, prompts=prompts)
    with pytest.raises(
        RewardCheckError, match=r"'clip' failed on a batch of 3 samples: ZeroDivisionError: boom"
    ) as error:
        checked_score(ScriptedReward(ZeroDivisionError("boom")), "clip", 3, prompts=prompts)
    assert isinstance(error.value.__cause__, ZeroDivisionError)


def test_non_utf8_yaml_names_the_file(tmp_path, capsys) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("recipe: bandit\nrun:\n  name: caf\xe9\n".encode("latin-1"))
    offset = len(b"recipe: bandit\nrun:\n  name: caf")  # where the Latin-1 e-acute sits
    with pytest.raises(ConfigError, match=rf"latin1\.yaml: not UTF-8 text \(byte {offset}:"):
        load_yaml(path)
    assert cli_main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmrl: error: {path}: not UTF-8") and err.count("\n") == 1


def test_cli_errors_are_one_line_and_the_traceback_needs_verbose(tmp_path, capsys) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("recipe: bandit\ntrainer:\n  steps: 1\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ["train", str(config), f"run.output_dir={blocker}", "run.progress=false"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"mmrl: error: run.output_dir: {blocker} is a file, not a folder; choose another run.output_dir\n"
    )
    assert cli_main(["train", str(config), f"run.output_dir={blocker}/runs", "run.progress=false"]) == 2
    assert f"run.output_dir: {blocker} is a file" in capsys.readouterr().err
    assert cli_main(["--verbose", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith(
        "mmrl: error:"
    )


def test_missing_vlm_path_names_the_folder_and_the_hub(tmp_path) -> None:
    from pipelines.vlm.hf_backend import load_vlm

    missing = tmp_path / "no_such_model"
    with pytest.raises(
        OSError, match=rf"cannot load the VLM '{missing}': there is no such folder and the .*Hub could not"
    ):
        load_vlm(str(missing))  # an absolute path: the working directory is not named


def test_a_folder_that_holds_no_loadable_model_is_named_with_the_loaders_reason(tmp_path) -> None:
    """A flow checkpoint given as a VLM, a VLM whose weights were cut short, a flow folder with a broken config:
    each names the path and the loader's reason, where the loaders' own errors named neither."""
    import shutil

    from pipelines.flow.adapters.registry import load_adapter
    from pipelines.vlm.hf_backend import load_vlm

    with pytest.raises(
        ValueError, match=r"cannot load the VLM from 'checkpoints/shapes_flow': it exists but"
    ):
        load_vlm("checkpoints/shapes_flow")
    cut = tmp_path / "cut_vlm"
    shutil.copytree("checkpoints/shapes_vlm", cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"cannot load the VLM from '{cut}': it exists but .*\(\w*Error"):
        load_vlm(str(cut))
    broken = tmp_path / "broken_flow"
    shutil.copytree("checkpoints/shapes_flow", broken)
    (broken / "model_index.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"cannot load the 'shapes' model from '{broken}': it exists but"):
        load_adapter("shapes", str(broken))


def test_a_device_name_torch_cannot_read_is_refused_when_the_config_loads() -> None:
    from mmrl.config import ConfigError, load_config
    from mmrl.flow.config import FlowGRPOConfig
    from mmrl.vlm.config import VLMRLVRConfig

    for schema, path in ((FlowGRPOConfig, "flow_shapes"), (VLMRLVRConfig, "vlm_shapes_single")):
        with pytest.raises(
            ConfigError, match=r"model.device: Value error, 'gpu' is not a device: use 'auto'"
        ):
            load_config(schema, f"configs/demo/{path}.yaml", ["model.device=gpu"])
        assert (
            load_config(schema, f"configs/demo/{path}.yaml", ["model.device=cuda:1"]).model.device == "cuda:1"
        )


def test_eval_images_per_prompt_below_one_is_a_usage_error(capsys) -> None:
    from mmrl.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "configs/demo/flow_shapes.yaml", "--images-per-prompt", "0"])
    assert exit_info.value.code == 2
    assert "argument --images-per-prompt: 0 is below 1" in capsys.readouterr().err
