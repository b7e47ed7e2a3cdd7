"""Scenes and the renderer: determinism, geometry (inside, apart, relations with a margin), prompt fidelity."""

from __future__ import annotations

import numpy as np
import pytest

from mmrl.data.shapes import (
    OFF_AXIS_MAX,
    RELATION_MIN,
    SIZE_RANGE,
    Scene,
    SceneObject,
    all_prompts,
    random_scene,
    render,
    render_prompt,
    sample_prompts,
    scene_for_prompt,
)
from rewards.shapes import PALETTE, parse_prompt, relation_offset, score_objects


def _gap(size: int) -> float:
    return max(3.0, 0.1 * size)


@pytest.mark.parametrize("size", [32, 64])
def test_rendering_is_deterministic_under_a_seed(size):
    prompt = "a photo of a red circle left of a blue square"
    a = np.asarray(render_prompt(prompt, seed=7, size=size))
    assert a.shape == (size, size, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, np.asarray(render_prompt(prompt, seed=7, size=size)))
    assert not np.array_equal(a, np.asarray(render_prompt(prompt, seed=8, size=size)))
    assert scene_for_prompt(prompt, 7, size) == scene_for_prompt(prompt, 7, size)
    assert random_scene(5, size) == random_scene(5, size)


@pytest.mark.parametrize("size", [32, 48, 64])
def test_scenes_satisfy_their_prompt_with_clear_geometry(size):
    for i, prompt in enumerate(sample_prompts(400, seed=size, split="all")):
        scene = scene_for_prompt(prompt, i, size)
        spec = parse_prompt(prompt)
        assert all(score_objects(spec, [o.as_detected() for o in scene.objects]).values())
        assert len(scene.objects) == len(spec.objects)
        for o in scene.objects:
            x0, y0, x1, y1 = o.box
            assert min(x0, y0) >= 1.0 and max(x1, y1) <= size - 1.0  # inside, with a margin
            assert 0.9**4 * SIZE_RANGE[0] * size <= o.size <= SIZE_RANGE[1] * size
        for j, a in enumerate(scene.objects):
            for b in scene.objects[j + 1 :]:
                reach = (a.size + b.size) / 2 + _gap(size)
                assert abs(a.x - b.x) >= reach or abs(a.y - b.y) >= reach  # boxes a clear gap apart
        if spec.relation is not None:
            dx, dy = relation_offset(scene.objects[0].box, scene.objects[1].box)
            along, across = {
                "left of": (-dx, dy),
                "right of": (dx, dy),
                "above": (-dy, dx),
                "below": (dy, dx),
            }[spec.relation]
            assert along >= RELATION_MIN and abs(across) <= OFF_AXIS_MAX


def test_scenes_vary_size_placement_and_background():
    scenes = [scene_for_prompt("a photo of a red circle", seed, 32) for seed in range(50)]
    assert len({s.background for s in scenes}) > 20
    assert np.ptp([s.objects[0].size for s in scenes]) > 2.0
    assert np.ptp([s.objects[0].x for s in scenes]) > 10.0
    counts = [scene_for_prompt("a photo of four squares", seed, 32) for seed in range(20)]
    assert len({o.colour for s in counts for o in s.objects}) == 6  # counting prompts: random colours


def test_render_draws_the_scene():
    scene = Scene(32, (200, 200, 200), (SceneObject("square", "blue", 10.0, 12.0, 8.0),))
    image = np.asarray(render(scene, antialias=False))
    assert tuple(image[12, 10]) == PALETTE["blue"]  # inside the square
    assert tuple(image[12, 15]) == (200, 200, 200)  # right of it
    assert tuple(image[0, 0]) == (200, 200, 200)
    soft = np.asarray(render(scene))
    assert tuple(soft[12, 10]) == PALETTE["blue"]


def test_every_prompt_renders_at_small_and_odd_sizes():
    for i, prompt in enumerate(all_prompts()[::97]):
        for size in (24, 40):
            assert render_prompt(prompt, i, size).size == (size, size)
    with pytest.raises(ValueError, match="size"):
        render_prompt("a photo of a red circle", 0, size=8)
    with pytest.raises(ValueError, match="n_objects"):
        random_scene(0, 32, n_objects=5)
