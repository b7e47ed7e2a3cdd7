"""FSDP2 gathering of master weights (mmrl.distributed.shard_model's ``param_dtype``), in one process: float32
shards, bfloat16 weights inside the forward, float32 gradients on the shards."""

import pytest
import torch
import torch.distributed as dist

from mmrl.distributed import shard_model
from tests.quant.test_quant import make_sd3

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None])
def test_the_forward_sees_the_gathered_dtype_and_the_shards_keep_theirs(tmp_path, param_dtype):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, inputs = make_sd3()
        seen = []
        model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(
            lambda m, a: seen.append(m.weight.dtype)
        )
        shard_model(model, param_dtype=param_dtype)
        out = model(**inputs).sample
        out.float().square().mean().backward()
        assert seen == [param_dtype or torch.float32]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}
    finally:
        dist.destroy_process_group()
