from pathlib import PurePosixPath

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


def test_a_damaged_or_foreign_checkpoint_is_named(tmp_path):
    good = save_checkpoint(tmp_path, 1, {"step": 1, "trainable": {"w": torch.zeros(2)}}) / "state.pt"
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:100])
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint")
    for file in (cut, empty, text):
        with pytest.raises(
            ValueError, match=rf"{file.name} is not a readable checkpoint .*delete {tmp_path}"
        ):
            load_checkpoint(file)
    with_object = tmp_path / "object.pt"
    torch.save({"step": 1, "path": PurePosixPath("a")}, with_object)
    with pytest.raises(
        ValueError, match=r"object.pt is not an mmrl checkpoint: it names a Python object .*PurePosixPath"
    ):
        load_checkpoint(with_object)
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(ValueError, match=r"list.pt is not an mmrl checkpoint \(it holds a list\)"):
        load_checkpoint(listed)
    with pytest.raises(ValueError, match=r"state.pt has no \['policy'\]: the checkpoint of another recipe"):
        load_checkpoint(good, require=("trainable", "policy"))


def test_load_trainable_names_tensors_of_another_shape():
    from mmrl.checkpoint import load_trainable

    module = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"weight \(8, 3\) \(the model: \(2, 3\)\)"):
        load_trainable(module, {"weight": torch.zeros(8, 3)})
    with pytest.raises(ValueError, match=r"parameters this model lacks, e.g. \['lora_A'\]"):
        load_trainable(module, {"lora_A": torch.zeros(2)})
    load_trainable(module, {"bias": torch.ones(2)})
    assert torch.equal(module.bias.detach(), torch.ones(2))
