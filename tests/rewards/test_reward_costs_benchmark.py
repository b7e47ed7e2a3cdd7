"""``python -m benchmarks.reward_costs``: a case named in ``--only`` is run, and a name that is no case is refused
(a typo had printed nothing and exited 0)."""

from __future__ import annotations

import pytest

from benchmarks import reward_costs


def test_only_runs_the_named_case_and_refuses_unknown_names(capsys):
    results = reward_costs.main(["--only", "shapes", "--n", "2", "--repeats", "1"])
    assert list(results) == ["shapes"] and results["shapes"]["ms_per_image"] > 0
    with pytest.raises(SystemExit):
        reward_costs.main(["--only", "shapes", "ocr_recognise"])
    error = capsys.readouterr().err
    assert "--only ocr_recognise: no such case" in error and "ocr_recognize" in error
