"""The VLM RLVR trainer on rollouts from an in-process pool: synchronous equals the in-loop path, asynchronous lag
stays bounded and stale samples are importance-weighted, APRIL partial rollouts are carried and consumed exactly
once, config validation. The committed shapes VLM, a few prompts per step."""

from __future__ import annotations

import itertools
import pickle
import sys
import time
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.core.losses import truncated_is_weights
from mmrl.seeding import request_seed
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.pooled import PooledVLMWorker, pooled_worker_factory
from mmrl.vlm.trainer import VLMRLVRTrainer
from pipelines.pool.weights import make_update
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.weight_sync import merged_state_dict

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm"
#: per-step metrics that only the pooled path has, or that measure wall time
POOL_ONLY = ("pool/", "tis/", "time/")


def make_cfg(*overrides: str) -> VLMRLVRConfig:
    return load_config(
        VLMRLVRConfig,
        None,
        [
            f"model.path={CHECKPOINT}",
            "model.device=cpu",
            "run.progress=false",
            "run.tensorboard=false",
            "data.train_limit=16",
            "data.eval_limit=4",
            "data.image_size=64",
            "generation.max_new_tokens=8",
            "allocation.prompts_per_step=6",
            "trainer.steps=3",
            "trainer.lr=1e-2",
            "trainer.beta=0.0",
            "trainer.minibatch_size=8",
            "trainer.num_generations=2",
            *overrides,
        ],
    )


def started(cfg: VLMRLVRConfig) -> VLMRLVRTrainer:
    trainer = VLMRLVRTrainer(cfg, run=None)
    trainer.setup()
    return trainer


def steps(trainer: VLMRLVRTrainer, n: int) -> list[dict[str, float]]:
    out = []
    for _ in range(n):
        out.append(trainer.train_step())
        trainer.step += 1
    return out


def lora(trainer: VLMRLVRTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.trainable]


def test_synchronous_pool_equals_in_loop_rollouts():
    cfg = make_cfg()
    plain = started(cfg)
    g = cfg.generation

    def request_seeded(examples, n, temperature, top_p):
        # the in-loop path with the seed the worker draws for the pool's single request of this step
        seed = request_seed(cfg.run.seed, 0, plain.step, 0)
        (sub,) = torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=g.max_new_tokens, n=n, seed=sub
        )
        result = plain.backend.generate([plain._prompt(ex) for ex in examples], params)
        return [(examples[s.prompt_index], s) for s in result.samples]

    plain.generate = request_seeded
    expected = steps(plain, 2)

    pooled = started(make_cfg("pool.enabled=true", "pool.max_staleness=0"))
    initial = lora(pooled)
    try:
        got = steps(pooled, 2)
        assert pooled.rollout_source.last.info["request_ids"] == ["step1-0"]
    finally:
        pooled.cleanup()
    for want, have in zip(expected, got, strict=True):
        assert have["pool/lag_max"] == 0 and have["pool/carried"] == 0 and have["pool/samples"] == 6
        assert "tis/weight_mean" not in have  # on-policy transformers samples are not re-weighted
        assert {k: v for k, v in have.items() if not k.startswith(POOL_ONLY)} == {
            k: v for k, v in want.items() if not k.startswith(POOL_ONLY)
        }
        # the same behaviour log-probs: the worker sampled exactly what the in-loop backend did
        assert have["tis/logprob_mismatch"] == want["tis/logprob_mismatch"] < 1e-4
    assert expected[0]["adv/std"] > 0  # a learning signal, so the LoRA moved
    for a, b in zip(plain.trainable, pooled.trainable, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(initial, pooled.trainable, strict=True))


def test_async_group_lag_is_bounded_and_stale_samples_are_weighted():
    trainer = started(
        make_cfg(
            "pool.enabled=true",
            "pool.max_staleness=1",
            "trainer.mode=group",
            "allocation.prompts_per_step=2",
            "trainer.tis_mode=sequence",
        )
    )
    seen = []
    original = trainer.loss_weights

    def record(old, behaviour, mask, row_lags):
        w = original(old, behaviour, mask, row_lags)
        seen.append((trainer.step, row_lags.clone(), w, mask))
        return w

    trainer.loss_weights = record
    metrics, lags = [], []
    try:
        for _ in range(3):
            metrics.append(trainer.train_step())
            lags.append(trainer.rollout_source.last.sample_lags)
            trainer.step += 1
    finally:
        trainer.cleanup()
    # step 0 is on-policy; steps 1 and 2 were generated (with the previous weights) while the previous step trained
    assert [int(lag.max()) for lag in lags] == [0, 1, 1] and all(int(lag.min()) >= 0 for lag in lags)
    assert [m["pool/lag_max"] for m in metrics] == [0, 1, 1] and all(m["pool/samples"] == 4 for m in metrics)
    assert "tis/weight_mean" not in metrics[0] and 0 < metrics[1]["tis/weight_mean"] <= 2.0
    for step, row_lags, w, mask in seen:
        if step == 0:
            assert w is None
            continue
        stale = row_lags > 0
        assert torch.equal(w[~stale], mask[~stale].float())  # lag 0: weight 1 (no engine TIS for hf)
        sw = w[stale][mask[stale].bool()]
        assert bool(((sw > 0) & (sw <= 2.0)).all())
        for row in w[stale]:  # sequence TIS: one weight per sample
            assert row[row > 0].unique().numel() == 1
    stale_w = torch.cat([w[lag > 0].flatten() for s, lag, w, _ in seen if s == 1])
    assert stale_w.numel() and not bool((stale_w[stale_w > 0] == 1).all())  # the policy moved after step 0


def test_overprovisioned_partial_rollouts_are_carried_and_consumed_once(monkeypatch):
    generate = PooledVLMWorker.generate

    def slow_tail(self, request):
        # requests 2 and 3 of a step are slow: the step's target (2 prompts) is met while they still run or wait
        if int(request.request_id.rsplit("-", 1)[1]) >= 2:
            time.sleep(0.4)
        return generate(self, request)

    monkeypatch.setattr(PooledVLMWorker, "generate", slow_tail)
    trainer = started(
        make_cfg(
            "pool.enabled=true",
            "pool.overprovision=1.0",
            "pool.prompts_per_request=1",
            "allocation.prompts_per_step=2",
            "trainer.steps=4",
        )
    )
    submitted, delivered, infos, metrics = [], [], [], []
    pool = trainer.rollout_source
    original_submit = pool.pool.submit

    def record_submit(requests, step=None):
        submitted.extend((step, r.request_id, tuple(r.prompt_ids)) for r in requests)
        return original_submit(requests, step=step)

    pool.pool.submit = record_submit
    try:
        for _ in range(4):
            metrics.append(trainer.train_step())
            info = pool.last.info
            infos.append(info)
            delivered.extend(info["request_ids"])
            trainer.step += 1
        left = set(pool.pending)
        # what the last step carried: delivered at the next version (also, no generation outlives the test: an
        # in-process worker's transformers sampling draws from the process's global RNG)
        pool.pool.broadcast(make_update(trainer.model, version=4))
        drained = [r.request_id for r in pool.pool.collect(4, timeout=60).results]
    finally:
        trainer.cleanup()
    ids = [rid for _, rid, _ in submitted]
    assert len(ids) == len(set(ids))  # every request id submitted once
    assert sorted(drained) == sorted(left) == sorted(infos[-1]["carried_ids"])
    assert sorted(delivered + drained) == sorted(
        ids
    )  # each delivered exactly once: none lost, none duplicated
    # step 0: 4 prompts in flight for a target of 2; the 2 slow ones are carried and delivered first at step 1
    assert [rid for s, rid, _ in submitted if s == 0] == [f"step0-{i}" for i in range(4)]
    assert infos[0]["request_ids"] == ["step0-0", "step0-1"] and infos[0]["carried_ids"] == [
        "step0-2",
        "step0-3",
    ]
    assert metrics[0]["pool/carried"] == 2 and metrics[0]["pool/samples"] == 2
    for prev, info in itertools.pairwise(infos):
        assert info["request_ids"][: len(prev["carried_ids"])] == prev["carried_ids"]
    # a step's new requests top it up to 4 prompts in flight, never with a prompt carried into it
    for step in range(1, 4):
        carried = {
            p for _, rid, prompts in submitted if rid in infos[step - 1]["carried_ids"] for p in prompts
        }
        new = [prompts for s, _, prompts in submitted if s == step]
        assert len(carried) + sum(len(p) for p in new) == 4 and not carried & {p for ps in new for p in ps}
    assert max(m["pool/lag_max"] for m in metrics) >= 1  # carried samples were made by an older version


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["generation.backend=vllm", "pool.device=cpu"], "leave pool.device null"),
        (["model.load_in_4bit=true"], "load_in_4bit"),
        (["pool.overprovision=0.5"], "prompts_per_request"),
        (
            ["pool.overprovision=0.5", "pool.prompts_per_request=1", "pool.max_staleness=2"],
            "max_staleness <= 1",
        ),
        (["pool.overprovision=-0.5"], "overprovision"),
        (["pool.tis_cap=0.5"], "tis_cap"),
        (["pool.executor=threads"], "executor"),
    ],
)
def test_pool_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_cfg("pool.enabled=true", *overrides)


def test_vllm_pool_members_own_engines_and_weight_lag0_samples(fake_vllm):
    cfg = make_cfg(
        "pool.enabled=true",
        "pool.max_staleness=0",
        "generation.backend=vllm",
        "generation.vllm_gpu_memory_utilization=0.2",
        "generation.vllm_fp8=true",
        "generation.vllm_max_images_per_prompt=3",
    )
    trainer = started(cfg)
    start = {k: v.clone() for k, v in merged_state_dict(trainer.model)}  # version 0: the trainer's LoRA
    try:
        metrics = steps(trainer, 2)
        old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
        behaviour = torch.full((2, 3), -1.5)
        mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        weights = trainer.loss_weights(old, behaviour, mask, torch.zeros(2, dtype=torch.long))
    finally:
        trainer.cleanup()
    # one engine, the pool member's, built with the trainer's engine arguments; the trainer evaluates with
    # transformers on its own model rather than holding a second engine
    (member,) = fake_vllm.engines
    assert isinstance(trainer.backend, HFBackend)
    shared = ("max_model_len", "gpu_memory_utilization", "quantization", "dtype", "seed")
    assert {k: member.kwargs[k] for k in shared} == {
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.2,
        "quantization": "fp8",
        "dtype": "float32",
        "seed": cfg.run.seed,
    }
    assert member.kwargs["enable_sleep_mode"] is False  # a member generates while the trainer trains
    assert member.kwargs["limit_mm_per_prompt"] == {"image": 3}  # multi-image prompts reach the engine
    # version 0 pushed once at start (the trainer's LoRA merged), version 1 at step 1
    assert len(member.loads) == 2
    assert member.loads[0].keys() == start.keys()
    for name, tensor in member.loads[0].items():
        torch.testing.assert_close(tensor, start[name], rtol=1e-6, atol=1e-6)
    assert any(not torch.equal(member.loads[1][k], start[k]) for k in start)  # the trained LoRA reached it
    # trainer.tis=auto is on for vLLM: lag-0 samples are weighted against the engine's log-probs, as in-loop
    assert trainer.uses_tis and all(m["pool/lag_max"] == 0 for m in metrics)
    assert all("tis/weight_mean" in m for m in metrics)
    c = cfg.trainer
    torch.testing.assert_close(
        weights, truncated_is_weights(old, behaviour, cap=c.tis_cap, mode=c.tis_mode, mask=mask)
    )


def test_vllm_pool_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install mmrl\[vllm\]"):
        started(make_cfg("pool.enabled=true", "generation.backend=vllm"))


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_pool_members_generate_with_the_configured_family(fake_vllm, backend):
    """``model.family`` reaches every member's backend through the (picklable) worker factory, as the in-loop
    trainer's backend gets it, instead of each backend detecting one from the checkpoint's ``model_type``."""
    cfg = make_cfg("pool.enabled=true", "model.family=qwen2_5_vl", f"generation.backend={backend}")
    factory = pooled_worker_factory(cfg.model, cfg.generation, cfg.pool, None, "cpu", cfg.run.seed)
    family = factory.keywords["family"]
    assert family.name == "qwen2_5_vl"
    assert pickle.loads(pickle.dumps(factory)).keywords["family"].name == "qwen2_5_vl"  # (Ray pickles it)
    assert factory().backend.family is family
    detected = make_cfg("pool.enabled=true", f"generation.backend={backend}")  # model.family null
    assert (
        pooled_worker_factory(detected.model, detected.generation, detected.pool, None, "cpu", 0).keywords[
            "family"
        ]
        is None
    )


def test_a_pooled_step_whose_every_prompt_is_too_long_names_the_length_settings():
    trainer = started(make_cfg("pool.enabled=true", "pool.max_staleness=0", "generation.max_prompt_length=8"))
    try:
        with pytest.raises(ValueError) as error:
            trainer.collect()
    finally:
        trainer.cleanup()
    assert str(error.value) == (
        "generation.max_prompt_length (8), generation.max_model_len (null): all 6 prompts of step 0 are too long "
        "for them (each one's length is in the warnings above); raise them or filter the data"
    )


def test_overprovision_beyond_the_train_set_is_refused():
    with pytest.raises(ValueError, match="train examples"):
        started(make_cfg("pool.enabled=true", "pool.overprovision=4.0", "pool.prompts_per_request=1"))


def test_synchronous_pool_resumes_exactly(tmp_path, interrupted_then_resumed):
    from mmrl.run import read_metrics
    from mmrl.vlm import trainer as trainer_module

    def cfg(name: str, *extra: str) -> VLMRLVRConfig:
        return make_cfg(
            "pool.enabled=true",
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.save_every=1",
            "trainer.eval_every=3",
            *extra,
        )

    straight = trainer_module.main(cfg("a"))
    # the new pool starts from the resumed LoRA as its version 0, the requests of step 2 have step 2's seeds
    resumed = interrupted_then_resumed(
        VLMRLVRTrainer, trainer_module.main, cfg("b"), cfg("b", "run.resume=true"), at=2
    )
    assert {k: v for k, v in resumed.items() if not k.startswith("time/")} == {
        k: v for k, v in straight.items() if not k.startswith("time/")
    }
    assert len(read_metrics(tmp_path / "b")) == 4


def test_ray_pool_trains_like_the_inprocess_pool():
    pytest.importorskip("ray")
    overrides = ("pool.enabled=true", "pool.max_staleness=0")
    local_trainer = started(make_cfg(*overrides))
    try:
        local = steps(local_trainer, 2)
    finally:
        local_trainer.cleanup()
    remote_trainer = started(
        make_cfg(*overrides, "pool.executor=ray", "pool.ray={num_cpus: 1}", "pool.request_timeout=300")
    )
    try:
        remote = steps(remote_trainer, 2)
    finally:
        remote_trainer.cleanup()
    # the same request seeds on a Ray actor: the same answers, rewards and updates
    for a, b in zip(local, remote, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(POOL_ONLY)} == pytest.approx(
            {k: v for k, v in b.items() if not k.startswith(POOL_ONLY)}, rel=1e-5, abs=1e-6
        )


@pytest.mark.parametrize(
    ("master", "optimizer"), [("float32", "adamw"), ("bfloat16", "adamw_kahan")], ids=["master", "pure-kahan"]
)
def test_a_bfloat16_full_fine_tune_samples_from_the_pool_what_it_scores(master, optimizer):
    """A pool worker holds a ``model.dtype`` copy of the policy. With float32 master weights the trainer scores
    under bfloat16 autocast from float32 weights, so the worker's pure bfloat16 log-probs differ from the re-scored
    ones (TIS covers it); in pure bfloat16 (KahanAdamW) worker and trainer run the same bfloat16 weights, synced
    after every step, and the two agree."""
    trainer = started(
        make_cfg(
            "pool.enabled=true",
            "pool.max_staleness=0",
            "model.lora=null",
            "model.dtype=bfloat16",
            f"model.master_weight_dtype={master}",
            f"trainer.optimizer={optimizer}",
            "trainer.lr=1e-4",
        )
    )
    try:
        metrics = steps(trainer, 2)
    finally:
        trainer.cleanup()
    mismatch = metrics[-1]["tis/logprob_mismatch"]  # the second step samples from the synced weights
    assert mismatch < 1e-4 if master == "bfloat16" else mismatch > 1e-3
