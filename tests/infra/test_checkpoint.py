import pytest
import torch

from mmrl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def test_save_load_latest_and_keep_last(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step, "w": torch.full((2,), float(step))}, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000003"
    assert torch.equal(load_checkpoint(latest)["w"], torch.full((2,), 3.0))


def test_crash_while_saving_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1})

    def crash(_dir):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 2, {"step": 2}, extra=crash)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001" and load_checkpoint(latest)["step"] == 1
    assert not (tmp_path / "step_00000002").exists()


def test_extra_files_land_inside_checkpoint(tmp_path):
    path = save_checkpoint(tmp_path, 5, {"step": 5}, extra=lambda d: (d / "adapter").mkdir())
    assert (path / "adapter").is_dir()


def test_missing_checkpoint_error(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope")
