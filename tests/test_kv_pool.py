"""The KV pool's size: what the user asks for, else room for a c=16 load or a long context at every
model size, within the memory free (`builder.kv_pool_blocks`)."""

from __future__ import annotations

import psutil
import pytest

from stratum.engine import builder
from stratum.engine.builder import KV_POOL_MIN_MB, KV_POOL_TOKENS, kv_pool_blocks

GiB = 2**30
BLOCK = 16


def per_block(layers: int, kv_heads: int, head_dim: int, nbytes: int = 4) -> int:
    return 2 * layers * kv_heads * head_dim * BLOCK * nbytes


SMOLLM2_135M = per_block(30, 3, 64)  # 46 KB a token in fp32
LLAMA_3B = per_block(28, 8, 128)  # 229 KB a token


@pytest.fixture
def free(monkeypatch):
    def set_free(nbytes: int) -> None:
        monkeypatch.setattr(builder, "free_memory", lambda device: nbytes)

    set_free(20 * GiB)
    return set_free


def test_an_asked_size_is_kept(free):
    free(1 * GiB)  # what the user asks for is not bounded by what is free
    assert kv_pool_blocks(2048, LLAMA_3B, BLOCK, 131072, "cpu") == 2048 * 2**20 // LLAMA_3B


def test_the_default_holds_the_same_tokens_at_every_model_size(free):
    for size in (SMOLLM2_135M, LLAMA_3B):
        assert kv_pool_blocks(None, size, BLOCK, 8192, "cpu") * BLOCK == KV_POOL_TOKENS
    # the fixed 256 MB it replaces: 1,168 tokens of the 3 B model, 6 sequences of 175
    assert 256 * 2**20 // LLAMA_3B * BLOCK < 16 * 175 <= KV_POOL_TOKENS


def test_a_long_context_fits_whole_up_to_twice_the_default(free):
    assert kv_pool_blocks(None, SMOLLM2_135M, BLOCK, 24576, "cpu") * BLOCK == 24576
    assert kv_pool_blocks(None, SMOLLM2_135M, BLOCK, 131072, "cpu") * BLOCK == 2 * KV_POOL_TOKENS


def test_the_default_takes_at_most_a_quarter_of_the_free_memory_and_never_less_than_the_minimum(free):
    free(4 * GiB)
    blocks = kv_pool_blocks(None, LLAMA_3B, BLOCK, 131072, "cpu")
    assert blocks == GiB // LLAMA_3B  # 32,768 tokens would be 7.3 GB
    free(256 * 2**20)
    assert kv_pool_blocks(None, LLAMA_3B, BLOCK, 131072, "cpu") == KV_POOL_MIN_MB * 2**20 // LLAMA_3B
    tiny = per_block(2, 2, 16)  # a small model's minimum pool holds far more than the default's tokens
    assert kv_pool_blocks(None, tiny, BLOCK, 2048, "cpu") == KV_POOL_MIN_MB * 2**20 // tiny


def test_free_memory_is_what_this_machine_reports():
    free = builder.free_memory("cpu")
    assert 0 < free <= psutil.virtual_memory().available + 2**26  # the two readings are a moment apart
