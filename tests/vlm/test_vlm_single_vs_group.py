"""The single-vs-group benchmark's variant selection (the runs themselves are the benchmark, not a test)."""

from __future__ import annotations

import pytest

from benchmarks.vlm_single_vs_group import main, selected, variants


def test_group_is_always_trained_and_the_order_is_the_tables():
    assert selected(["single"]) == ["single", "group"]
    assert selected(["group", "single_no_entropy"]) == ["single_no_entropy", "group"]
    assert selected(list(variants(4))) == ["single", "single_no_entropy", "group"]


def test_variants_keep_rollouts_per_step_equal():
    for extra in variants(4).values():
        per_step = {item.split("=")[1] for item in extra if item.startswith("allocation.prompts_per_step")}
        generations = {item.split("=")[1] for item in extra if item.startswith("trainer.num_generations")}
        assert int(per_step.pop()) * int(generations.pop() if generations else 1) == 32


def test_an_unknown_variant_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--variants", "singel"])
    assert "singel" in capsys.readouterr().err
