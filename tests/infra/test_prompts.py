import pytest

from mmrl.data.prompts import load_prompts
from mmrl.data.shapes import heldout_prompts, prompt_kind


def test_prompt_sources(tmp_path):
    assert load_prompts("shapes:heldout") == heldout_prompts()
    balanced = load_prompts("shapes:heldout@8")
    assert [prompt_kind(p) for p in balanced] == ["single", "count", "pair", "relation"] * 2
    f = tmp_path / "p.txt"
    f.write_text("# comment\n  a  red   circle \n\nsecond prompt\n")
    assert load_prompts(str(f)) == ["a red circle", "second prompt"]


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("shapes:test", "unknown shapes split"),
        ("shapes:heldout@x", "positive integer"),
        ("/nope.txt", "not found"),
    ],
)
def test_bad_prompt_sources(source, match):
    with pytest.raises(ValueError, match=match):
        load_prompts(source)


def test_empty_and_binary_files(tmp_path):
    empty = tmp_path / "e.txt"
    empty.write_text("\n# only a comment\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        load_prompts(str(empty))
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompts(str(binary))
