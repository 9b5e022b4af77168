"""What the disk tier reads and writes of the KV pool: its blocks as bytes (`PoolView`), and what binds
those bytes to the numerics that computed them (`kv_binding`), so no other step, model or dtype reads them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from stratum.engine.disk_store import FORMAT
from stratum.home import stratum_home


def kv_binding(config, model, checkpoint_path: Path) -> bytes:
    """Everything that changes the KV a step writes, hashed: the model file's identity, the KV shape,
    dtype and device, the pool's layout (the native step keeps keys transposed per block), the kernel
    plan's decision, and the kernels' build (native) or torch and its CPU path and threads (PyTorch).
    A cold start's provisional PyTorch step and the native step it switches to bind differently.

    The one place the tier's binding is computed: with issue 32's record (`ResolvedConfig.numerics`)
    it is that record's key (and the block size); the rest of the body is for a tree without it."""
    numerics = getattr(config, "numerics", None)  # issue 32's record, where it has landed: the one key of KV numerics
    if numerics is not None:
        ident = {"tier_format": FORMAT, "numerics": numerics.key(), "block_size": config.block_size}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()
    from stratum.kernels import native

    native_step = model.packed is not None
    mc, plan = model.config, config.kernel_plan
    if native_step:
        kernels = [native.build_dir(stratum_home()).name]
    else:
        kernels = [torch.__version__, torch.backends.cpu.get_cpu_capability(), config.num_threads, config.prefill_threads]
    ident = {"tier_format": FORMAT, "model": _file_identity(Path(checkpoint_path)),
             "kv": [mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size, config.dtype, config.device],
             "layout": "native, keys transposed per block" if native_step else "slot-major",
             "plan": list(plan.decision), "kernels": kernels}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()


def _file_identity(path: Path) -> list:
    """What the loader's own cache keys a checkpoint on: path, size and modification time (each file of a folder)."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [str(path.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


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
