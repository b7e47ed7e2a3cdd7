"""The flow-family registry: decorator registration, one generic from_pretrained, errors naming the families."""

import pytest
from diffusers import StableDiffusion3Pipeline

from pipelines.flow.adapters import (
    FlowAdapter,
    SanaAdapter,
    SD3Adapter,
    ShapesAdapter,
    get_adapter,
    list_adapters,
    load_adapter,
    register_flow_family,
)


def test_every_family_is_registered_with_its_pipeline_class():
    assert list_adapters() == [
        "flux",
        "flux2",
        "flux2_klein",
        "qwen_image",
        "sana",
        "sd3",
        "shapes",
        "wan",
        "wan22",
        "z_image",
    ]
    for name in list_adapters():
        cls = get_adapter(name)
        assert cls.family == name and issubclass(cls, FlowAdapter)
        assert cls.from_pretrained.__func__ is FlowAdapter.from_pretrained.__func__  # written once
    assert SanaAdapter.adapter_options() == ["max_sequence_length", "complex_human_instruction"]


def test_generic_from_pretrained_splits_adapter_and_loading_options():
    adapter = load_adapter("shapes", "checkpoints/shapes_flow")
    assert isinstance(adapter, ShapesAdapter) and adapter.max_sequence_length == 0  # the family's default
    adapter = load_adapter("sd3", "checkpoints/shapes_flow", max_sequence_length=3, local_files_only=True)
    assert type(adapter) is SD3Adapter and adapter.max_sequence_length == 3


def test_unknown_and_duplicate_families_are_named():
    with pytest.raises(KeyError, match=r"Available: \['flux', 'flux2', 'flux2_klein', 'qwen_image', 'sana'"):
        get_adapter("sdxl")
    with pytest.raises(ValueError, match="already registered to SD3Adapter"):

        @register_flow_family("sd3")
        class Another(SD3Adapter):
            pipeline_class = StableDiffusion3Pipeline
