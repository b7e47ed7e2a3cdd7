"""``mmrl export``: every export loads back with the base model's own library (diffusers, transformers, peft) and
holds what was trained; the model card; the Hub upload against a local mock of the Hub's HTTP API; the VLM's
full fine-tune checkpoint folder; the VLM run report's gallery."""

import base64
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from mmrl.cli import main as cli_main
from mmrl.config import load_config
from mmrl.data.shapes import all_prompts
from mmrl.data.shapes_vqa import make_vqa_items
from mmrl.export import export_run, push_to_hub
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import main as flow_main
from mmrl.run import read_metrics
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.trainer import main as vlm_main
from pipelines.flow.tiny import build_shapes_pipeline
from pipelines.vlm.tiny import build_tiny_vlm


def load_as_the_card_says(export_dir, monkeypatch) -> dict:
    """Run the model card's Python snippet from the export's parent folder; returns its variables."""
    from huggingface_hub import ModelCard

    snippet = re.search(
        r"```python\n(.*?)```", ModelCard.load(export_dir / "README.md").text, flags=re.S
    ).group(1)
    monkeypatch.chdir(export_dir.parent)
    variables: dict = {}
    exec(compile(snippet, "README.md", "exec"), variables)
    return variables


# ----------------------------------------------------------------------------------------------------- flow
@pytest.fixture(scope="module")
def flow_model(tmp_path_factory):
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8)
    path = tmp_path_factory.mktemp("shapes_tiny")
    pipe.save_pretrained(path)
    return path


def flow_run(model_dir, out, name, *overrides):
    cfg = load_config(
        FlowGRPOConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={out}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "sampling.sde_window=2",
            "allocation.prompts_per_step=2",
            "allocation.rollouts_per_step=8",
            "trainer.steps=2",
            "trainer.eval_every=1",
            "trainer.eval_prompts=4",
            "trainer.minibatch_size=8",
            "trainer.lr=1e-2",
            "rewards=[{name: jpeg_incompressibility}]",
            *overrides,
        ],
    )
    flow_main(cfg)
    return out / name, cfg


@pytest.fixture(scope="module")
def flow_lora_run(flow_model, tmp_path_factory):
    return flow_run(flow_model, tmp_path_factory.mktemp("runs"), "lora", "run.save_every=1")


def test_flow_lora_export_loads_with_load_lora_weights(flow_lora_run, tmp_path, monkeypatch):
    run, _ = flow_lora_run
    out = export_run(run, tmp_path / "lora", checkpoint=1, license="apache-2.0")
    exported = load_file(out / "pytorch_lora_weights.safetensors")
    saved = load_file(run / "checkpoints/step_00000001/adapter/pytorch_lora_weights.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    pipe = load_as_the_card_says(out, monkeypatch)["pipe"]  # the base pipeline + load_lora_weights
    state = torch.load(run / "checkpoints/step_00000001/state.pt", weights_only=False)["trainable"]
    loaded = {
        n.replace(".default_0", ".default"): p for n, p in pipe.transformer.named_parameters() if "lora" in n
    }
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[n], state[n]) for n in state)
    # the model card: Hub front matter, and the held-out scores of the exported step from metrics.jsonl
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert (
        card.data.license == "apache-2.0"
        and card.data.library_name == "diffusers"
        and "lora" in card.data.tags
    )
    by_step = {r["step"]: r for r in read_metrics(run)}
    assert (
        f"| `eval/reward_mean` | {by_step[0]['eval/reward_mean']:.4f} | {by_step[1]['eval/reward_mean']:.4f} |"
        in card.text
    )
    assert "pipe.load_lora_weights" in card.text and (out / "training_config.yaml").is_file()


def test_a_damaged_weights_or_config_file_is_named_before_anything_is_written(flow_lora_run, tmp_path):
    """A copy would ship a cut-short adapter as it is; the export names it and writes nothing."""
    import shutil

    run, _ = flow_lora_run
    damaged = tmp_path / "damaged_run"
    shutil.copytree(run, damaged)
    weights = damaged / "checkpoints/step_00000001/adapter/pytorch_lora_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"pytorch_lora_weights.safetensors is damaged \(SafetensorError"):
        export_run(damaged, tmp_path / "out", checkpoint=1)
    assert not (tmp_path / "out").exists()
    shutil.copy2(run / "checkpoints/step_00000001/adapter/pytorch_lora_weights.safetensors", weights)
    config = (
        damaged / "checkpoints/step_00000001/adapter/adapter_config.json"
    )  # (peft's; diffusers writes none)
    config.write_text("{broken")
    with pytest.raises(ValueError, match=rf"{config.name} is damaged \(JSONDecodeError"):
        export_run(damaged, tmp_path / "out", checkpoint=1)
    config.unlink()
    # a metrics line the model card cannot read is found after the weights are written: nothing is left
    # behind, and the same command runs once the line is mended
    metrics = damaged / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + "{cut\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not valid JSON"):
        export_run(damaged, tmp_path / "out", checkpoint=1)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-out"))
    metrics.write_text("".join(lines))
    assert (export_run(damaged, tmp_path / "out", checkpoint=1) / "README.md").is_file()


def test_flow_lora_merged_export_is_a_pipeline_with_w_plus_scaled_ba(
    flow_model, flow_lora_run, tmp_path, monkeypatch
):
    from diffusers import SD3Transformer2DModel

    run, cfg = flow_lora_run
    assert cli_main(["export", str(run), "--to", str(tmp_path / "merged"), "--merge"]) == 0
    pipe = load_as_the_card_says(tmp_path / "merged", monkeypatch)[
        "pipe"
    ]  # DiffusionPipeline.from_pretrained
    merged = dict(pipe.transformer.named_parameters())
    base = dict(SD3Transformer2DModel.from_pretrained(flow_model, subfolder="transformer").named_parameters())
    lora = load_file(run / "checkpoints/step_00000002/adapter/pytorch_lora_weights.safetensors")
    scale = cfg.model.lora.alpha / cfg.model.lora.rank
    layers = [k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in lora if ".lora_A." in k]
    assert layers
    for layer in layers:
        a, b = lora[f"transformer.{layer}.lora_A.weight"], lora[f"transformer.{layer}.lora_B.weight"]
        expected = base[f"{layer}.weight"] + scale * b @ a
        torch.testing.assert_close(merged[f"{layer}.weight"], expected, atol=1e-6, rtol=1e-5)
        assert not torch.equal(merged[f"{layer}.weight"], base[f"{layer}.weight"])
    untouched = [n for n in base if not any(n.startswith(layer + ".") for layer in layers)]
    assert untouched and all(torch.equal(merged[n], base[n]) for n in untouched)


def test_flow_full_finetune_export_and_errors(flow_model, tmp_path, monkeypatch):
    run, _ = flow_run(flow_model, tmp_path, "full", "model.lora=null", "trainer.objective=nft")
    out = export_run(run, tmp_path / "full_export")
    state = torch.load(run / "checkpoints/step_00000002/state.pt", weights_only=False)["trainable"]
    named = dict(load_as_the_card_says(out, monkeypatch)["pipe"].transformer.named_parameters())
    assert named.keys() == state.keys() and all(torch.equal(named[n], state[n]) for n in state)
    with pytest.raises(FileExistsError, match="not empty"):
        export_run(run, out)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7; its checkpoints: \[2\]"):
        export_run(run, tmp_path / "x", checkpoint=7)
    with pytest.raises(ValueError, match="--merge applies to LoRA runs"):
        export_run(run, tmp_path / "y", merge=True)


def test_the_export_of_a_resumed_run_holds_the_config_it_continued_with(flow_model, flow_lora_run, tmp_path):
    """After `trainer.steps=3` on resume, the card says 3 of 3 steps and training_config.yaml trains 3 steps
    as a fresh run (with run.resume it would continue a run directory of that name)."""
    import shutil

    from huggingface_hub import ModelCard

    run, _ = flow_lora_run
    shutil.copytree(run, tmp_path / "runs/lora")
    resumed, _ = flow_run(
        flow_model, tmp_path / "runs", "lora", "run.save_every=1", "trainer.steps=3", "run.resume=true"
    )
    out = export_run(resumed, tmp_path / "export")
    card = ModelCard.load(out / "README.md").text
    assert "for 3 of 3 steps" in card
    assert "- resumed with `trainer.steps: 2 -> 3`: `training_config.yaml` holds the final values" in card
    config = load_config(FlowGRPOConfig, out / "training_config.yaml")
    assert config.trainer.steps == 3 and not config.run.resume and config.run.resume_changes == []


def test_a_missing_lora_folder_is_named_before_the_model_loads(flow_model, flow_lora_run, tmp_path, capsys):
    """Not as a Hub repository id diffusers cannot validate, after the model loaded."""
    import shutil

    from mmrl.config import ConfigError
    from pipelines.flow.adapters import load_adapter

    run, _ = flow_lora_run
    shutil.copytree(run, tmp_path / "lora")
    checkpoint = tmp_path / "lora/checkpoints/step_00000002"
    shutil.rmtree(checkpoint / "adapter")
    expected = (
        f"mmrl: error: FileNotFoundError: {checkpoint} has no LoRA folder ({checkpoint / 'adapter'}, "
        "holding pytorch_lora_weights.safetensors) though model.lora is set: a LoRA run's checkpoint holds "
        "one; a full fine-tune's is evaluated with model.lora=null"
    )
    assert cli_main(["eval", str(tmp_path / "lora")]) == 2
    assert " ".join(capsys.readouterr().err.split()) == expected
    # a full fine-tune's checkpoint (state.pt only) evaluated with a LoRA config
    argv = ["eval", "configs/demo/flow_shapes.yaml", "model.lora={rank: 4}", "--checkpoint", str(checkpoint)]
    assert cli_main([*argv, "--out", str(tmp_path / "eval")]) == 2
    assert " ".join(capsys.readouterr().err.split()) == expected
    # model.init_lora: a local folder must exist when the config loads; a Hub id namespace/name is left to
    # the Hub
    with pytest.raises(
        ConfigError, match=r"model\.init_lora: Value error, no LoRA folder at /nonexistent: give"
    ):
        load_config(FlowGRPOConfig, None, ["model.init_lora=/nonexistent"])
    assert load_config(FlowGRPOConfig, None, ["model.init_lora=someone/shapes-lora"]).model.init_lora
    adapter = load_adapter("shapes", str(flow_model), torch_dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(
        FileNotFoundError, match=rf"no LoRA folder at {checkpoint / 'adapter'}: a LoRA is a folder"
    ):
        adapter.load_lora(checkpoint / "adapter")


# ----------------------------------------------------------------------------------------------------- Hub upload
class _MockHub(BaseHTTPRequestHandler):
    """The Hub endpoints ``create_repo`` + ``upload_folder`` call, answering as the Hub does: every file goes
    "regular" (inline in the commit's NDJSON), so the commit carries the bytes."""

    requests: ClassVar[list] = []
    files: ClassVar[dict] = {}

    def _json(self, obj: dict, code: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._json({"error": "not found"}, 404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.requests.append((self.path, self.headers.get("Authorization"), body))
        endpoint = os.environ["HF_ENDPOINT"]
        if self.path == "/api/repos/create":
            request = json.loads(body)
            self._json({"url": f"{endpoint}/{request['organization']}/{request['name']}"})
        elif self.path == "/api/validate-yaml":
            self._json({})
        elif self.path.endswith("/preupload/main"):
            files = json.loads(body)["files"]
            self._json(
                {
                    "files": [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                    ]
                }
            )
        elif self.path.endswith("/commit/main"):
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            self._json({"commitUrl": f"{endpoint}/me/shapes/commit/{'a' * 40}", "commitOid": "a" * 40})
        else:
            self._json({"error": "not found"}, 404)

    def log_message(self, *args):
        pass


def test_push_to_hub_uploads_the_export_through_huggingface_hub(flow_lora_run, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _MockHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)  # (read once, when huggingface_hub is imported)
    monkeypatch.setattr(
        hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    try:
        out = export_run(flow_lora_run[0], tmp_path / "export")
        url = push_to_hub(out, "me/shapes", private=True, token="hf_test_token")
    finally:
        server.shutdown()
    assert url == f"{endpoint}/me/shapes/commit/{'a' * 40}"
    paths = [path for path, _, _ in _MockHub.requests]
    assert paths[0] == "/api/repos/create" and paths[-1] == "/api/models/me/shapes/commit/main"
    create = json.loads(_MockHub.requests[0][2])
    assert create["visibility"] == "private" and create["name"] == "shapes" and create["organization"] == "me"
    assert all(auth == "Bearer hf_test_token" for _, auth, _ in _MockHub.requests)
    on_disk = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert _MockHub.files == on_disk


# ----------------------------------------------------------------------------------------------------- VLM
@pytest.fixture(scope="module")
def vlm_model(tmp_path_factory):
    torch.manual_seed(0)
    items = make_vqa_items(60, seed=0)
    corpus = [i.prompt for i in items] + [f"<answer>{i.answer}</answer>" for i in items]
    path = tmp_path_factory.mktemp("tiny_vlm")
    build_tiny_vlm(corpus, out_dir=path)
    return path


def vlm_run(model_dir, out, name, *overrides):
    cfg = load_config(
        VLMRLVRConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={out}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "data.train_limit=24",
            "data.eval_limit=6",
            "generation.max_new_tokens=6",
            "allocation.prompts_per_step=4",
            "trainer.steps=1",
            "trainer.lr=1e-2",
            "trainer.minibatch_size=4",
            "trainer.eval_every=1",
            "trainer.sample_every=1",
            # random weights never answer right: the format reward gives the step some signal
            "rewards=[{name: exact_match}, {name: format, options: {}, weight: 0.5}]",
            *overrides,
        ],
    )
    vlm_main(cfg)
    return out / name


def _logits(model, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_vlm_lora_exports_load_with_peft_and_transformers(vlm_model, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    run = vlm_run(vlm_model, tmp_path, "lora", "trainer.mode=single")
    assert (run / "checkpoints/step_00000001/adapter/processor_config.json").is_file()  # processor beside it
    adapter = export_run(run, tmp_path / "adapter")
    merged = export_run(run, tmp_path / "merged", merge=True)
    with_adapter = load_as_the_card_says(
        adapter, monkeypatch
    )  # PeftModel.from_pretrained(base, DIR), processor
    with_merged = load_as_the_card_says(
        merged, monkeypatch
    )  # AutoModelForImageTextToText.from_pretrained(DIR)
    vocab = len(with_merged["processor"].tokenizer)
    assert len(with_adapter["processor"].tokenizer) == vocab
    base_logits = _logits(AutoModelForImageTextToText.from_pretrained(vlm_model).eval(), vocab)
    peft_logits = _logits(with_adapter["model"].eval(), vocab)
    merged_logits = _logits(with_merged["model"].eval(), vocab)
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=1e-4)
    assert (peft_logits - base_logits).abs().max() > 1e-4  # the step moved the adapter off zero
    # the run report's VLM gallery: question image, question, completion, answer, verdict
    page = (run / "report.html").read_text()
    record = json.loads((run / "samples/eval_00000001.jsonl").read_text().splitlines()[0])
    assert {"question", "answer", "completion", "reward", "exact_match", "format", "grid_box"} <= set(record)
    records = [json.loads(line) for line in (run / "samples/eval_00000001.jsonl").read_text().splitlines()]
    for r in records:  # full marks are the weights' sum, 1.5
        expected = "correct" if r["reward"] >= 1.5 else "wrong" if r["reward"] <= 0 else "partial"
        assert r["verdict"] == expected and r["reward"] == pytest.approx(r["exact_match"] + 0.5 * r["format"])
    assert 'class="verdict' in page and "<b>completion</b>" in page and "<b>answer</b>" in page


def test_vlm_full_finetune_checkpoint_is_a_from_pretrained_folder(vlm_model, tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    run = vlm_run(vlm_model, tmp_path, "full", "model.lora=null", "trainer.mode=single")
    checkpoint = run / "checkpoints/step_00000001"
    state = torch.load(checkpoint / "state.pt", weights_only=False)["trainable"]
    saved = dict(AutoModelForImageTextToText.from_pretrained(checkpoint / "model").named_parameters())
    AutoProcessor.from_pretrained(checkpoint / "model")
    assert state and all(torch.equal(saved[n], state[n]) for n in state)
    base = dict(AutoModelForImageTextToText.from_pretrained(vlm_model).named_parameters())
    assert any(not torch.equal(base[n], state[n]) for n in state)
    out = export_run(run, tmp_path / "export")
    exported = dict(load_as_the_card_says(out, monkeypatch)["model"].named_parameters())
    assert all(torch.equal(exported[n], saved[n]) for n in saved)
