import pytest
import torch
from hypothesis import settings

# No per-example time limit for the property tests: timing is what benchmarks measure, and on a shared 2-core CPU
# an example's first call (lazy kernel set-up, a neighbour's job) can take 300 ms where the next takes 1 ms.
settings.register_profile("mmrl", deadline=None)
settings.load_profile("mmrl")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def interrupted_then_resumed(monkeypatch):
    """``run(trainer_cls, main, crash_cfg, resume_cfg, at)``: ``main(crash_cfg)`` interrupted by a
    KeyboardInterrupt when the trainer is about to run step ``at + 1``, then ``main(resume_cfg)``; returns the
    resumed run's final metrics (the exact-resume tests of every recipe)."""

    def run(trainer_cls, main, crash_cfg, resume_cfg, at: int):
        original = trainer_cls.train_step

        def crash(self):
            if self.step == at:
                raise KeyboardInterrupt
            return original(self)

        monkeypatch.setattr(trainer_cls, "train_step", crash)
        with pytest.raises(KeyboardInterrupt):
            main(crash_cfg)
        monkeypatch.setattr(trainer_cls, "train_step", original)
        return main(resume_cfg)

    return run
