"""The same engine on CUDA. Skipped cleanly where no GPU is present (CI here); run on a lent GPU machine."""

from __future__ import annotations

import pytest
import torch

from stratum.engine import LLM
from stratum.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

PROMPTS = ["The capital of Japan is", "def add(a, b):\n    return", "Once upon a time, a dragon"]


def _run(model, device: str, dtype: str):
    llm = LLM(str(model), device=device, dtype=dtype, num_kv_blocks=256)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, return_logits=True)
    ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    seqs = [llm.engine.add_request(x, params, request_id=f"c{i}") for i, x in enumerate(ids)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.block_manager.check_integrity()
    return seqs


def test_cuda_fp32_matches_cpu_fp32(tiny_model_dir):
    cpu = _run(tiny_model_dir, "cpu", "float32")
    gpu = _run(tiny_model_dir, "cuda", "float32")
    for a, b in zip(cpu, gpu):
        assert a.output_token_ids == b.output_token_ids
        for pos in a.readouts.logits:
            assert torch.allclose(a.readouts.logits[pos], b.readouts.logits[pos], atol=1e-3), pos


@pytest.mark.integration
def test_cuda_bf16_real_model_answers(real_model_path):
    llm = LLM(str(real_model_path), device="cuda", dtype="bfloat16")
    out = llm.chat([{"role": "user", "content": "What is the capital of Japan?"}],
                   SamplingParams(max_tokens=16, temperature=0.0))
    assert "Tokyo" in out.text
    assert llm.engine.kernel_plan.device == "cuda" and llm.engine.dtype == torch.bfloat16
