"""Prompt grammar of the shapes world: the finite prompt set, parsing, the train/held-out split, prompt files."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from mmrl.data.prompts import check_prompts, load_prompts
from mmrl.data.shapes import (
    COLOURS,
    KINDS,
    RELATIONS,
    SHAPES,
    all_prompts,
    canonical_prompt,
    heldout_prompts,
    is_heldout,
    near_miss_prompts,
    prompt_kind,
    sample_prompts,
    train_prompts,
    write_prompt_file,
)
from rewards.shapes import ObjectSpec, PromptSpec, ShapesReward, parse_prompt

# the first held-out prompts in all_prompts() order, computed once by the documented formula; a change here
# means evaluation sets of earlier runs are no longer comparable
EXPECTED_HELDOUT_HEAD = [
    "a photo of a green triangle",
    "a photo of a purple triangle",
    "a photo of four circles",
    "a photo of three triangles",
    "a photo of a red circle and a red triangle",
    "a photo of a red circle and a orange triangle",
    "a photo of a green circle and a orange square",
    "a photo of a green circle and a purple triangle",
    "a photo of a blue circle and a yellow square",
    "a photo of a blue circle and a orange triangle",
    "a photo of a yellow circle and a orange square",
    "a photo of a yellow circle and a yellow triangle",
]


def test_all_prompts_is_the_whole_grammar():
    prompts = all_prompts()
    n_objects = len(SHAPES) * len(COLOURS)
    n_pairs = n_objects * (n_objects - 1)
    assert len(prompts) == n_objects + 4 * len(SHAPES) + n_pairs + n_pairs * len(RELATIONS) == 1560
    assert len(set(prompts)) == len(prompts)
    assert prompts == all_prompts()  # deterministic order
    assert all(p == p.lower() and p.startswith("a photo of ") for p in prompts)
    assert Counter(prompt_kind(p) for p in prompts) == {
        "single": 18,
        "count": 12,
        "pair": n_pairs,
        "relation": n_pairs * 4,
    }


def test_every_prompt_round_trips_through_the_parser():
    for prompt in all_prompts():
        assert parse_prompt(prompt).to_prompt() == prompt


@pytest.mark.parametrize(
    ("prompt", "spec"),
    [
        ("a photo of a red circle", PromptSpec("single", (ObjectSpec("circle", "red"),))),
        ("a photo of one triangle", PromptSpec("count", (ObjectSpec("triangle"),))),
        ("a photo of three squares", PromptSpec("count", (ObjectSpec("square"),) * 3)),
        (
            "a photo of a blue square and a orange circle",
            PromptSpec("pair", (ObjectSpec("square", "blue"), ObjectSpec("circle", "orange"))),
        ),
        (
            "a photo of a green triangle right of a green circle",
            PromptSpec(
                "relation", (ObjectSpec("triangle", "green"), ObjectSpec("circle", "green")), "right of"
            ),
        ),
        ("  A photo of a  Red circle ", PromptSpec("single", (ObjectSpec("circle", "red"),))),
    ],
)
def test_parse_prompt(prompt, spec):
    assert parse_prompt(prompt) == spec


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "a photo of a pink circle",
        "a photo of a red hexagon",
        "a photo of five circles",
        "a photo of two circle",
        "a photo of a red circles",
        "a photo of one circles",
        "a photo of a red circle next to a blue square",
        "a photo of a red circle and a red circle",
        "a photo of a red circle left of a red circle",
        "a red circle",
        "a photo of a red circle.",
    ],
)
def test_unparseable_prompt_raises_naming_it(prompt):
    with pytest.raises(ValueError, match="cannot parse shapes prompt") as info:
        parse_prompt(prompt)
    assert repr(prompt) in str(info.value)


def _formula(prompt: str, fraction: float = 0.2) -> bool:
    digest = hashlib.sha256(canonical_prompt(prompt).encode("utf-8")).hexdigest()
    return int(digest[:16], 16) / 2**64 < fraction


def test_split_is_the_documented_formula_and_stable():
    assert heldout_prompts()[: len(EXPECTED_HELDOUT_HEAD)] == EXPECTED_HELDOUT_HEAD
    assert all(is_heldout(p) == _formula(p) for p in all_prompts())
    assert len(heldout_prompts()) == 290


def test_split_is_disjoint_and_complete():
    train, heldout = set(train_prompts()), set(heldout_prompts())
    assert not train & heldout
    assert train | heldout == set(all_prompts())
    for kind in KINDS:  # every template is evaluated
        assert any(prompt_kind(p) == kind for p in heldout)
    assert heldout_prompts(fraction=0.0) == [] and train_prompts(fraction=1.0) == []
    with pytest.raises(ValueError, match="fraction"):
        is_heldout("a photo of a red circle", fraction=1.5)


def test_prompts_of_one_scene_share_a_split():
    assert canonical_prompt("a photo of a blue square and a red circle") == (
        "a photo of a red circle and a blue square"
    )
    assert canonical_prompt("a photo of a red circle right of a blue square") == (
        "a photo of a blue square left of a red circle"
    )
    assert canonical_prompt("a photo of a red circle below a blue square") == (
        "a photo of a blue square above a red circle"
    )
    for prompt in all_prompts():
        spec = parse_prompt(prompt)
        if spec.kind == "relation":
            flipped = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
            twin = PromptSpec("relation", spec.objects[::-1], flipped[spec.relation]).to_prompt()
            assert is_heldout(twin) == is_heldout(prompt)
        elif spec.kind == "pair":
            assert is_heldout(PromptSpec("pair", spec.objects[::-1]).to_prompt()) == is_heldout(prompt)


def test_sample_prompts_deterministic_balanced_and_in_split():
    a = sample_prompts(400, seed=3, split="heldout")
    assert a == sample_prompts(400, seed=3, split="heldout")
    assert a != sample_prompts(400, seed=4, split="heldout")
    assert set(a) <= set(heldout_prompts())
    assert [prompt_kind(p) for p in a[:8]] == list(KINDS) * 2
    # drawn without replacement until a pool runs out: the 2 held-out single prompts alternate
    singles = a[0::4]
    assert len(set(singles[:2])) == 2
    unbalanced = sample_prompts(50, seed=0, split="train", balanced=False)
    assert len(set(unbalanced)) == 50 and set(unbalanced) <= set(train_prompts())
    with pytest.raises(ValueError, match="split"):
        sample_prompts(3, seed=0, split="test")


def test_near_miss_prompts_are_one_edit_away():
    misses = near_miss_prompts("a photo of a red circle left of a blue square")
    assert "a photo of a green circle left of a blue square" in misses
    assert "a photo of a red triangle left of a blue square" in misses
    assert "a photo of a red circle above a blue square" in misses
    assert "a photo of a red circle left of a blue square" not in misses
    assert len(misses) == 2 * (5 + 2) + 3
    assert sorted(near_miss_prompts("a photo of two circles")) == [
        "a photo of four circles",
        "a photo of one circle",
        "a photo of three circles",
        "a photo of two squares",
        "a photo of two triangles",
    ]
    # an edit never produces a prompt outside the grammar (no identical pair)
    assert "a photo of a red circle and a red circle" not in near_miss_prompts(
        "a photo of a red circle and a blue circle"
    )


def test_prompt_file_round_trip(tmp_path):
    prompts = sample_prompts(20, seed=0, split="heldout")
    path = write_prompt_file(tmp_path / "eval.txt", prompts)
    assert path.read_text().splitlines() == prompts
    assert load_prompts(str(path)) == prompts
    with pytest.raises(ValueError, match="a photo of a pink circle"):
        write_prompt_file(tmp_path / "bad.txt", [*prompts, "a photo of a pink circle"])
    assert not (tmp_path / "bad.txt").exists()
    bad = tmp_path / "bad.txt"
    bad.write_text("# comment\n\na photo of a red circle\na photo of a pink circle\n")
    with pytest.raises(ValueError, match=r"bad\.txt line 4: .*a photo of a pink circle"):
        check_prompts(str(bad), load_prompts(str(bad)), [ShapesReward()])
