"""Run reports: metric grouping, the grid/sample layout, and the page of a short real flow run, checked without a
browser (every embedded image decodes and has content) and in headless Chromium (no console error, images
rendered, the screenshot is not blank)."""

import base64
import contextlib
import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.cli import main as cli_main
from mmrl.config import RunConfig, load_config
from mmrl.data.shapes import all_prompts
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import main as flow_main
from mmrl.images import grid_boxes, make_grid
from mmrl.report import metric_panels, moving_average, render_report
from mmrl.run import Run, read_metrics
from pipelines.flow.tiny import build_shapes_pipeline

IMG_SRC = re.compile(r'<img[^>]*\ssrc="([^"]+)"')


def decode_images(page: str) -> list[Image.Image]:
    """Every ``<img>`` of the page, decoded; each must be an embedded PNG."""
    images = []
    for src in IMG_SRC.findall(page):
        assert src.startswith("data:image/png;base64,"), src[:80]
        images.append(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))
    return images


def test_metric_panels_draw_every_key_once_in_named_groups():
    keys = [
        "step",
        "time",
        "reward/mean",
        "reward/shapes/mean",
        "reward/shapes/count",
        "reward/clip/mean",
        "eval/reward_mean",
        "eval/shapes/mean",
        "eval/shapes/count",
        "eval/accuracy",
        "eval/accuracy_count",
        "eval/reward_mean_count",
        "loss",
        "policy/kl",
        "policy/ratio_mean",
        "clip/low_frac",
        "clip/high_frac",
        "entropy/mean",
        "nfe/total",
        "nfe/rollout",
        "rollouts/total",
        "time/rollout_s",
        "time/train_s",
        "time/wait_s",
        "time/generate_s",
        "gen/length_mean",
    ]
    panels = {p.title: p for p in metric_panels(keys)}
    assert panels["Reward"].keys == ("reward/mean", "reward/clip/mean", "reward/shapes/mean")
    assert panels["Reward components: shapes"].keys == ("reward/shapes/count",)
    assert set(panels["Held-out scores"].keys) == {"eval/reward_mean", "eval/shapes/mean", "eval/accuracy"}
    assert set(panels["Held-out breakdown"].keys) == {
        "eval/shapes/count",
        "eval/accuracy_count",
        "eval/reward_mean_count",
    }
    assert panels["KL to the reference"].keys == ("policy/kl",)
    split = panels["Step time split (s)"]
    assert split.stacked and split.keys == ("time/rollout_s", "time/train_s")
    # a pool's wait is inside the rollout time and its workers' generation overlaps training: not stacked
    overlapping = panels["Time, overlapping the step (s)"]
    assert not overlapping.stacked and set(overlapping.keys) == {"time/wait_s", "time/generate_s"}
    assert panels["NFE total"].keys == ("nfe/total",) and panels["NFE per step"].keys == ("nfe/rollout",)
    drawn = [k for p in panels.values() for k in p.keys]
    assert sorted(drawn) == sorted(set(keys) - {"step", "time"})  # every key exactly once


def test_moving_average_is_the_trailing_mean():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0, 9.0], 1) == [2.0, 4.0, 9.0]
    assert moving_average([3.0, 6.0, 9.0], 5) == [3.0, 4.5, 6.0]


def test_grid_boxes_locate_each_image_of_make_grid():
    torch.manual_seed(0)
    images = torch.rand(7, 3, 5, 9)
    grid = make_grid(images)
    for image, box in zip(images, grid_boxes(7, 9, 5), strict=True):
        crop = torch.from_numpy(np.array(grid.crop(box))).permute(2, 0, 1).float() / 255
        torch.testing.assert_close(crop, image, atol=0.5 / 255, rtol=0)


def test_save_samples_records_where_each_image_is_in_the_grid(tmp_path):
    run = Run(RunConfig(output_dir=str(tmp_path), name="s", tensorboard=False), RunConfig())
    torch.manual_seed(0)
    videos = torch.rand(3, 5, 3, 6, 4)  # [B, T, 3, H, W]
    path = run.save_samples(7, "eval", [{"prompt": f"p{i}", "reward": float(i)} for i in range(3)], videos)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    grid = Image.open(path.with_suffix(".png"))
    for i, record in enumerate(records):
        assert record["prompt"] == f"p{i}" and record["frame"] == 2
        crop = torch.from_numpy(np.array(grid.crop(tuple(record["grid_box"])))).permute(2, 0, 1).float() / 255
        torch.testing.assert_close(crop, videos[i, 2], atol=0.5 / 255, rtol=0)
    pil = [Image.new("RGB", (5, 3), (10 * i, 0, 0)) for i in range(2)]
    path = run.save_samples(8, "train", [{"question": "q"}, {"question": "r"}], pil)
    boxes = [json.loads(line)["grid_box"] for line in path.read_text().splitlines()]
    assert boxes == [[2, 2, 7, 5], [9, 2, 14, 5]]  # 2 pixels of padding, two columns
    with pytest.raises(ValueError, match="2 images for 1 records"):
        run.save_samples(9, "train", [{"question": "q"}], pil)
    run.close()


def test_a_sample_grid_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A process killed while writing the grid leaves no PNG cut short for `mmrl report` to trip on."""
    run = Run(RunConfig(output_dir=str(tmp_path), name="s", tensorboard=False), RunConfig())
    images = torch.rand(2, 3, 8, 8)
    kept = run.save_samples(1, "eval", [{"prompt": "a"}, {"prompt": "b"}], images).with_suffix(".png")
    original = Image.Image.save

    def killed_while_writing(self, fp, format=None, **params):
        whole = io.BytesIO()
        original(self, whole, format="PNG")
        with open(fp, "wb") if isinstance(fp, str | Path) else contextlib.nullcontext(fp) as f:
            f.write(whole.getvalue()[:40])
        raise KeyboardInterrupt

    monkeypatch.setattr(Image.Image, "save", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        run.save_samples(2, "eval", [{"prompt": "a"}, {"prompt": "b"}], images)
    monkeypatch.undo()
    assert not (tmp_path / "s/samples/eval_00000002.png").exists()
    Image.open(kept).load()  # the earlier grid is whole
    run.close()


def test_read_metrics_leaves_out_a_half_written_last_line_and_names_a_bad_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1,\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not valid JSON"):
        read_metrics(tmp_path)


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A short real flow run (tiny random shapes model, LoRA GRPO, 3 steps) whose loop wrote report.html."""
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8)
    model_dir = tmp_path_factory.mktemp("shapes_tiny")
    pipe.save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        FlowGRPOConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={out}",
            "run.name=short",
            "run.progress=false",
            "run.tensorboard=false",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "sampling.sde_window=2",
            "allocation.prompts_per_step=2",
            "allocation.rollouts_per_step=8",
            "trainer.steps=3",
            "trainer.eval_every=2",
            "trainer.eval_prompts=6",
            "trainer.minibatch_size=8",
            "trainer.lr=1e-2",
            "trainer.sample_every=1",
            "rewards=[{name: jpeg_incompressibility}, {name: shapes, weight: 0.0}]",
        ],
    )
    flow_main(cfg)
    return out / "short"


def test_training_writes_a_self_contained_report(flow_run):
    page = (flow_run / "report.html").read_text()
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched: works offline
    assert "<script" not in page
    images = decode_images(page)
    records = read_metrics(flow_run)
    panels = metric_panels({k for r in records for k in r})
    eval_steps = sorted(int(p.stem.split("_")[1]) for p in (flow_run / "samples").glob("eval_*.jsonl"))
    train_steps = sorted(int(p.stem.split("_")[1]) for p in (flow_run / "samples").glob("train_*.jsonl"))
    assert eval_steps == [0, 2, 3] and train_steps == [1, 2, 3]
    # one plot per panel, then one thumbnail per sample shown
    shown = sum(
        len((flow_run / "samples" / f"{tag}_{s:08d}.jsonl").read_text().splitlines())
        for tag, steps in (("eval", eval_steps), ("train", train_steps))
        for s in steps
    )
    assert len(images) == len(panels) + shown
    for image in images:  # none blank: every plot and thumbnail has more than one colour
        assert image.width > 0 and len(image.getcolors(maxcolors=1 << 24)) > 1
    # each sample's prompt and scores are on its card
    eval_record = json.loads((flow_run / "samples/eval_00000003.jsonl").read_text().splitlines()[0])
    assert eval_record["prompt"] in page and {"reward", "jpeg_incompressibility", "shapes"} <= set(
        eval_record
    )
    train_record = json.loads((flow_run / "samples/train_00000003.jsonl").read_text().splitlines()[0])
    assert "advantage" in train_record and train_record["prompt"] in page
    # the summary reads the held-out score from the metrics: first and last evaluation
    first, last = records[0]["eval/reward_mean"], records[-1]["eval/reward_mean"]
    assert f"{first:.4g} (step 0) → {last:.4g} (step 3)" in page
    # log.txt holds each evaluation and each step's key metrics
    log = (flow_run / "log.txt").read_text()
    assert f"step 0 evaluation: eval/reward_mean={first:.4g}" in log
    assert re.search(r"step 3/3: reward/mean=\S+ .*loss=", log)
    assert f"step 3 evaluation: eval/reward_mean={last:.4g}" in log


def test_report_of_a_run_still_writing(flow_run, tmp_path):
    run = tmp_path / "running"
    shutil.copytree(flow_run, run)
    (run / "summary.json").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # the trainer is appending this line
    page = render_report(run)
    assert "in progress" in page and "3 of 3" in page


def test_a_damaged_config_or_summary_is_named(flow_run, tmp_path):
    from mmrl.config import ConfigError

    run = tmp_path / "damaged"
    shutil.copytree(flow_run, run)
    (run / "summary.json").write_text('{"step": 3, ')
    with pytest.raises(ValueError, match=r"damaged/summary.json is not valid JSON"):
        render_report(run)
    (run / "config.yaml").write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match=r"damaged/config.yaml: invalid YAML"):
        render_report(run)


def test_an_unreadable_sample_image_is_named_and_the_rest_of_the_report_drawn(flow_run, tmp_path):
    run = tmp_path / "cut"
    shutil.copytree(flow_run, run)
    grid = run / "samples/eval_00000003.png"
    grid.write_bytes(grid.read_bytes()[:200])  # cut short
    page = render_report(run)
    assert f"{grid} cannot be read (OSError: image file is truncated" in page
    assert "its samples are shown without images" in page
    records = (run / "samples/eval_00000003.jsonl").read_text().splitlines()
    assert json.loads(records[0])["prompt"] in page
    # every other step's thumbnails are still there: one image fewer per sample of that step only
    assert len(decode_images(page)) == len(decode_images(render_report(flow_run))) - len(records)


def test_cli_report_and_compare_overlay_runs(flow_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(flow_run, other)
    (other / "config.yaml").write_text(
        (other / "config.yaml").read_text().replace("name: short", "name: other")
    )
    assert cli_main(["report", str(other), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r/report.html").is_file()
    assert cli_main(["compare", str(flow_run), str(other), "--out", str(tmp_path / "c")]) == 0
    page = (tmp_path / "c/compare.html").read_text()
    keys = {k for r in read_metrics(flow_run) for k in r} - {"step", "time"}
    images = decode_images(page)
    assert len(images) == len(keys)  # one overlay per metric
    assert all(len(im.getcolors(maxcolors=1 << 24)) > 1 for im in images)
    assert "short" in page and "other" in page
    assert cli_main(["compare", str(flow_run)]) == 2  # one run is not a comparison


# --------------------------------------------------------------------------------------------- headless Chromium
def chromium_binary() -> str | None:
    return next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
    )


async def _devtools_page_check(
    binary: str, url: str, profile: Path
) -> tuple[list[str], list[dict], bytes, bytes]:
    """Open ``url`` in headless Chromium over the DevTools protocol: ``(console errors and exceptions, every image's
    {complete, naturalWidth, naturalHeight}, screenshot PNG, screenshot PNG of a blank page)``."""
    import aiohttp

    proc = subprocess.Popen(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1200,1600",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            async with session.ws_connect(ws_url, max_msg_size=0) as ws:
                counter, errors = 0, []

                async def call(method: str, **params):
                    nonlocal counter
                    counter += 1
                    await ws.send_json({"id": counter, "method": method, "params": params})
                    while True:
                        message = await ws.receive_json(timeout=60)
                        if message.get("id") == counter:
                            return message.get("result", {})
                        record(message)

                def record(message: dict) -> None:
                    method, params = message.get("method"), message.get("params", {})
                    if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                        errors.append(f"console.{params['type']}: {params['args']}")
                    elif method == "Runtime.exceptionThrown":
                        errors.append(f"exception: {params['exceptionDetails']}")
                    elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                        errors.append(f"log: {params['entry']['text']}")

                async def shot() -> bytes:
                    data = await call("Page.captureScreenshot", format="png")
                    return base64.b64decode(data["data"])

                for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
                    await call(domain)
                blank = await shot()
                await call("Page.navigate", url=url)
                while True:  # until the page's load event, recording what it logs on the way
                    message = await ws.receive_json(timeout=60)
                    record(message)
                    if message.get("method") == "Page.loadEventFired":
                        break
                result = await call(
                    "Runtime.evaluate",
                    returnByValue=True,
                    expression=(
                        "JSON.stringify(Array.from(document.images).map(i => ({complete: i.complete, "
                        "naturalWidth: i.naturalWidth, naturalHeight: i.naturalHeight})))"
                    ),
                )
                images = json.loads(result["result"]["value"])
                return errors, images, await shot(), blank
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_report_renders_in_headless_chromium(flow_run, tmp_path):
    import asyncio

    binary = chromium_binary()
    if binary is None:
        pytest.skip(
            "no chromium binary on PATH (Debian: apt-get install chromium); the browser-free checks of "
            "test_training_writes_a_self_contained_report still ran"
        )
    page = flow_run / "report.html"
    errors, images, screenshot, blank = asyncio.run(
        _devtools_page_check(binary, page.resolve().as_uri(), tmp_path / "profile")
    )
    assert errors == []
    assert len(images) == len(IMG_SRC.findall(page.read_text())) > 0
    assert all(im["complete"] and im["naturalWidth"] > 0 and im["naturalHeight"] > 0 for im in images)
    shown = np.asarray(Image.open(io.BytesIO(screenshot)).convert("L"), dtype=np.float64)
    empty = np.asarray(Image.open(io.BytesIO(blank)).convert("L"), dtype=np.float64)
    assert shown.shape == empty.shape
    assert empty.std() == 0  # the blank page is one colour
    # the report's first screen (title, summary, the first plots: lines on white) differs from the blank page
    assert (np.abs(shown - empty) > 16).mean() > 0.02 and shown.std() > 20
