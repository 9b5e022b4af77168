"""The context a model is served at: never beyond what it was trained for unless the user names a RoPE
scaling that reaches it (`stratum serve --max-model-len N --rope-scaling yarn|linear`, as llama.cpp's
flags), and YaRN computed as its paper and transformers compute it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch

from stratum.layers.rotary import RotaryEmbedding, attention_factor, rope_inv_freq
from stratum.models.config import ContextLengthError, ModelConfig
from tests.conftest import ServerProcess

TINY = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=2048, name="tiny")


def test_a_longer_context_without_scaling_is_refused_by_name():
    cfg = ModelConfig(**TINY)
    assert cfg.with_context(None) is cfg and cfg.with_context(1024) is cfg
    with pytest.raises(ContextLengthError) as info:
        cfg.with_context(4096)
    assert ("--max-model-len 4096" in str(info.value) and "2048" in str(info.value)
            and "--rope-scaling" in str(info.value))


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_a_named_scaling_extends_the_context(kind):
    cfg = ModelConfig(**TINY)
    by_length = cfg.with_context(8192, kind)
    assert by_length.max_position_embeddings == 8192
    assert by_length.rope_scaling == {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 2048}
    by_factor = cfg.with_context(None, kind, factor=2.0)
    assert by_factor.max_position_embeddings == 4096 and by_factor.rope_scaling["factor"] == 2.0
    with pytest.raises(ContextLengthError, match="beyond the 4096 tokens"):
        cfg.with_context(8192, kind, factor=2.0)
    with pytest.raises(ContextLengthError, match="above 1"):
        cfg.with_context(None, kind)


def test_yarn_is_transformers_yarn():
    """Frequencies and attention factor as transformers computes them for the same settings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=576, num_attention_heads=9, head_dim=64, max_position_embeddings=32768,
                     rope_theta=100000.0, rope_scaling=scaling)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = rope_inv_freq(64, 100000.0, scaling)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert attention_factor(scaling) == pytest.approx(factor)
    table = RotaryEmbedding(64, 16, 100000.0, scaling)  # the tables every path reads carry the factor
    assert table.cos[0, 0].item() == pytest.approx(factor)


def test_serve_refuses_a_context_beyond_the_trained_one(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "stratum.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
                        "--max-model-len", "4096", "--data-dir", ""], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "--max-model-len 4096 is beyond" in r.stdout + r.stderr and "trained context of 2048" in r.stdout + r.stderr


def test_serve_extends_the_context_when_asked(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8",
                           "--max-model-len", "4096", "--rope-scaling", "yarn").wait_ready()
    try:
        prompt = "the capital of Japan is Tokyo. " * 300  # about 2,700 tokens: beyond the trained 2,048
        r = httpx.post(server.url + "/v1/messages", timeout=300, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]}).json()
        assert 2048 < r["usage"]["input_tokens"] < 4096 and r["usage"]["output_tokens"] >= 1, r
        over = httpx.post(server.url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]})
        assert over.status_code == 400 and "5000 > 4096" in over.json()["error"]["message"]
    finally:
        server.stop()
