"""Tiny pipelines of every family, built once per session, saved, and reloaded through the adapters."""

from __future__ import annotations

import pytest
import torch

from pipelines.flow.adapters import get_adapter
from pipelines.flow.tiny import TINY_LOAD_KWARGS, build_tiny_pipeline


@pytest.fixture(scope="session", autouse=True)
def _few_threads():
    # The CPU is shared: tiny models gain nothing from a second thread, and two OpenMP threads spin-waiting
    # on a loaded machine are much slower than one.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def saved_pipelines(tmp_path_factory):
    """``{family: directory}`` of tiny pipelines written with ``save_pretrained``."""
    dirs = {}
    for family in TINY_LOAD_KWARGS:
        directory = tmp_path_factory.mktemp(f"tiny_{family}")
        build_tiny_pipeline(family, seed=0).save_pretrained(directory)
        dirs[family] = directory
    return dirs


@pytest.fixture
def load_tiny(saved_pipelines):
    """Load a fresh adapter of ``family`` from its saved directory (fresh: tests may add LoRA to it)."""

    def load(family: str):
        return get_adapter(family).from_pretrained(str(saved_pipelines[family]), **TINY_LOAD_KWARGS[family])

    return load
