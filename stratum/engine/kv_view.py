"""What the disk tier reads and writes of the KV pool: its blocks as bytes (`PoolView`), and what binds
those bytes to the numerics that computed them (`kv_binding`), so no other step, model or dtype reads them."""

from __future__ import annotations

import hashlib
import json

import torch

from stratum.engine.disk_store import FORMAT


def kv_binding(config, model) -> bytes:
    """What binds the tier's blocks to the numerics that computed them: the numerics rule's record of
    everything that decides the KV's bits (`config.numerics.key()`: the model file's identity, the
    step, dtypes, weight forms, attention kernels, kernel-numerics version), the block size, and the
    pool's layout (the native step keeps keys transposed per block). Read from the engine's config
    at the time of use: a cold start's provisional step and the native step it switches to differ."""
    ident = {"tier_format": FORMAT, "numerics": config.numerics.key(), "block_size": config.block_size,
             "layout": "native, keys transposed per block" if model.packed is not None else "slot-major"}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()


class PoolView:
    """The KV pool as bytes per block: each pool tensor (every layer's K, then V) holds a block as one
    run of contiguous bytes, whatever layout the step keeps inside it."""

    def __init__(self, kv_caches, num_blocks: int):
        tensors = [t for kv in kv_caches for t in kv]
        self.rows = [t.reshape(-1).view(torch.uint8).view(num_blocks, -1) for t in tensors]
        self.on_cpu = tensors[0].device.type == "cpu"
        self.arrays = [r.numpy() for r in self.rows] if self.on_cpu else None
        self.block_bytes = sum(r.shape[1] for r in self.rows)
        self.epochs = [0] * num_blocks  # bumped when the pool evicts the block (its bytes may change after)

    def chunks(self, block: int) -> list:
        """The block's bytes: views of the pool itself on the CPU, copies from a device."""
        if self.on_cpu:
            return [a[block] for a in self.arrays]
        return [r[block].cpu().numpy() for r in self.rows]

    def copy(self, block: int) -> bytes:
        return b"".join(memoryview(c) for c in self.chunks(block))

    def target(self, block: int) -> list:
        """Where a read of the block goes: the pool itself on the CPU, host buffers for a device."""
        if self.on_cpu:
            return [a[block] for a in self.arrays]
        return [torch.empty(r.shape[1], dtype=torch.uint8).numpy() for r in self.rows]

    def commit(self, block: int, buffers: list) -> None:
        if not self.on_cpu:
            for r, b in zip(self.rows, buffers):
                r[block].copy_(torch.from_numpy(b))
