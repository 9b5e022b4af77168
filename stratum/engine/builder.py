"""Model and kernel construction: settings + checkpoint -> a resolved configuration and a ready model.

`resolve` is the one place "auto" becomes a value (device, dtype, threads, kernel plan, context
length, KV blocks, sampling defaults). `build_model` loads the weights in the planned dtype and
attaches the packed kernels the plan chose.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from stratum.engine.config import EngineConfig, ResolvedConfig
from stratum.home import stratum_home
from stratum.kernels import native
from stratum.kernels import KernelPlan
from stratum.kernels.plan import Shapes, select_plan
from stratum.kernels.packed import LAYOUT_VERSION as PACKED_LAYOUT
from stratum.kernels.packed import FUSED, PACKED_QTYPES, PackedStack, PackedWeight, native_step_refusal
from stratum.kernels.packed import pack as packed_weight
from stratum.kernels.quant import Int4Weight, Int8Weight, Q8Weight, is_packable, unpack_q4, unpack_q8_0
from stratum.layers.linear import Linear
from stratum.models.llama import LlamaForCausalLM
from stratum.models.loader import Checkpoint, load_checkpoint
from stratum.models.registry import resolve_model_path, sampling_defaults

log = logging.getLogger("stratum.engine")


def load(config: EngineConfig) -> Checkpoint:
    return load_checkpoint(resolve_model_path(config.model))


def default_threads(serving: bool, native_step: bool = False) -> int:
    """$STRATUM_NUM_THREADS, else every core; a server on the PyTorch step leaves one core to its
    HTTP side.

    Measured on the 2-core reference machine: with the PyTorch step, 1 engine thread served 1.6x (one
    stream) and 1.16x (32 streams) the tokens/s of 2 threads, whose spin-waiting lost to the server's
    own work. With the native step it is the other way round (`stratum bench compare`, 2 threads
    over 1, Intel machine): 1.69x at one stream, 1.34x at 16 unique streams, 1.27x at 32 streams
    under a shared prompt and 1.27x on the multiturn workload.
    """
    env = int(os.environ.get("STRATUM_NUM_THREADS", 0) or 0)
    if env > 0:
        return env
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if serving and not native_step else cores


def resolve(config: EngineConfig, checkpoint: Checkpoint) -> ResolvedConfig:
    """Every "auto" of config, decided once for this machine and this checkpoint."""
    mc = checkpoint.config
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # every core where the native step runs; otherwise a server leaves one to its HTTP side, and the
    # plan at that thread count decides (one plan measured, not two, where the step wins)
    threads = config.num_threads or default_threads(config.serving, native_step=True)
    plan = _plan(config, checkpoint, device, threads)
    narrower = default_threads(config.serving)
    if not config.num_threads and not plan.packed_step and narrower != threads:
        threads, plan = narrower, _plan(config, checkpoint, device, narrower)
    prefill_threads = config.prefill_threads or max(threads, os.cpu_count() or 1)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    per_block = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * config.block_size * (2 if plan.dtype == "bfloat16" else 4)
    num_blocks = config.num_kv_blocks or max(16, config.kv_cache_memory_mb * 2**20 // per_block)
    defaults = sampling_defaults(config.model)
    return ResolvedConfig(
        model=config.model, device=device, dtype=plan.dtype, block_size=config.block_size, num_kv_blocks=num_blocks,
        max_model_len=max_model_len, enable_prefix_cache=config.enable_prefix_cache, num_threads=threads,
        prefill_threads=prefill_threads, kernel_plan=plan, seed=config.seed, scheduler=config.scheduler,
        default_temperature=defaults.get("temperature", 1.0), default_top_p=defaults.get("top_p", 1.0),
    )


def _plan(config: EngineConfig, checkpoint: Checkpoint, device: str, threads: int) -> KernelPlan:
    mc = checkpoint.config
    if device != "cpu":
        dtype = "bfloat16" if config.dtype == "auto" else config.dtype
        return KernelPlan(device, dtype, threads, 0, source="default")
    # the native step runs every PACKED_QTYPES format (int4, PyTorch's kernel, Q4_0 / Q4_1 among them)
    can_pack = any(t.qtype in PACKED_QTYPES for t in checkpoint.quantized.values())
    if config.int4_max_tokens is not None and config.dtype != "auto":  # fully specified: nothing to measure
        plan = KernelPlan("cpu", config.dtype, threads, 0, source="configured")
    else:
        plan = select_plan(stratum_home(), Shapes.of(mc), threads, can_pack, config.dtype, remeasure=config.remeasure_plan)
    if config.int4_max_tokens is not None:  # the configured row limit holds for both packed formats
        rows = config.int4_max_tokens if plan.dtype == "bfloat16" else 0
        plan = replace(plan, int4_max_tokens=rows if can_pack else 0, q8_max_rows=rows if native.available() else 0,
                       source="configured")
    if config.native_step is not None:
        plan = replace(plan, packed_step=config.native_step and can_pack and native.available(), source="configured")
    return plan


def build_model(config: ResolvedConfig, checkpoint: Checkpoint) -> tuple[LlamaForCausalLM, int]:
    """The model on its device in the planned dtype, with the plan's packed kernels attached.

    Takes the checkpoint's tensors (it is empty afterwards). Returns (model, bytes of packed int4 weights).
    """
    plan = config.kernel_plan
    model = LlamaForCausalLM(checkpoint.config, max_positions=config.max_model_len)
    model.load_weights(dict(checkpoint.weights))
    model.cast_weights(config.torch_dtype)
    model = model.to(device=torch.device(config.device)).eval()
    checkpoint.weights.clear()  # the model holds them now
    model.packed_refusal = native_step_refusal(checkpoint.config, checkpoint.quantized)
    if model.packed_refusal is not None and checkpoint.quantized:
        log.warning("%s: the native step does not run this model: %s", checkpoint.config.name, model.packed_refusal)
    if plan.packed_step and model.packed_refusal is None and attach_packed(model, checkpoint.quantized, checkpoint.cache_dir):
        checkpoint.quantized.clear()
        return model, model.packed.nbytes
    int4_bytes = attach_int4(model, checkpoint.quantized, plan.int4_max_tokens, checkpoint.cache_dir)
    attach_q8_head(model, checkpoint.quantized, plan.q8_max_rows)
    if config.dtype != "float32":
        attach_q8_embedding(model, checkpoint.quantized)
    if config.device == "cpu" and config.dtype == "bfloat16":  # the low-latency hint's output projection
        head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
        model.lm_head_int8 = Int8Weight(head)
    checkpoint.quantized.clear()
    return model, int4_bytes


def attach_packed(model, quantized: dict, cache_dir: Path | None = None) -> bool:
    """Run every layer through the native step on the checkpoint's own blocks, when each projection
    is in one of PACKED_QTYPES (and the output projection too, when it is).

    The repacked blocks are kept in cache_dir/packed-<layout version>.pt when a cache is given: repacking takes
    seconds at every start otherwise. The dense copies of the projections are dropped: the step
    never reads them. The embedding stays (looked up from the Q8_0 table as stored where the file has
    one), and the output projection runs on the same kernel for every row, so a token's logits do not
    depend on the batch around it.

    Returns:
        Whether the step was attached (False: some projection is in another format).
    """
    cache = cache_dir / f"packed-{PACKED_LAYOUT}.pt" if cache_dir is not None else None
    saved = None
    if cache is not None and cache.exists():
        try:
            saved = torch.load(cache, weights_only=True)
        except (OSError, RuntimeError, ValueError):
            saved = None
    if saved is None:
        name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
        head = quantized.get(name)
        head = packed_weight(head.qtype, head.data, head.shape) if head is not None and head.qtype in PACKED_QTYPES else None
        layers = PackedStack.pack_layers(quantized, model.config.num_layers)
        saved = {"layers": [[[w.saved() for w in segments] for segments in projections] for projections in layers]
                 if layers is not None else None, "head": head.saved() if head is not None else None}
        if saved["layers"] is not None and cache is not None:
            try:
                torch.save(saved, cache)
            except OSError:
                pass  # only costs the repacking on the next start
    if saved["layers"] is None:
        return False
    model.packed = PackedStack(model, [[[PackedWeight(*w) for w in segments] for segments in projections]
                                       for projections in saved["layers"]])
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    if saved["head"] is not None:
        model.packed_head = PackedWeight(*saved["head"])
    attach_q8_embedding(model, quantized)
    if model.lm_head is not None and model.packed_head is not None:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    return True


def attach_int4(model, quantized: dict, max_tokens: int, cache_dir: Path | None = None) -> int:
    """Give every projection whose parts are all GGUF Q4 tensors a packed int4 copy.

    Packing is done once per checkpoint and kept in cache_dir/int4.pt when a cache is given.

    Returns:
        The bytes of packed weights attached (0 when nothing was packable).
    """
    if max_tokens <= 0:
        return 0
    cache = cache_dir / "int4.pt" if cache_dir is not None else None
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if cache is not None and cache.exists():
        try:
            packed = torch.load(cache, weights_only=True)
        except (OSError, RuntimeError, ValueError):
            packed = {}
    total, fresh = 0, not packed
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED.items():
            module: Linear = layer.get_submodule(fused)
            key = f"layers.{i}.{fused}"
            if key in packed:
                module.int4 = Int4Weight.from_packed(*packed[key], module.out_features, module.in_features)
            else:
                tensors = [quantized.get(f"model.layers.{i}.{p}.weight") for p in parts]
                if any(t is None or not is_packable(t.qtype) for t in tensors):
                    continue
                unpacked = [unpack_q4(t.qtype, t.data, t.shape) for t in tensors]
                q, scale, zero = (torch.cat([u[j] for u in unpacked]) for j in range(3))
                module.int4 = Int4Weight(q, scale, zero)
                packed[key] = (module.int4.packed, module.int4.scale_zeros)
            module.int4_max_tokens = max_tokens
            total += module.int4.nbytes
    if cache is not None and fresh and packed:
        try:
            torch.save(packed, cache)
        except OSError:
            pass  # only costs the packing time on the next start
    return total


def attach_q8_head(model, quantized: dict, max_rows: int) -> int:
    """Give the model its output projection as stored when that is GGUF Q8_0 (tied or not).

    Returns:
        The bytes attached (0 when the plan never uses it or the checkpoint has no Q8_0 head).
    """
    name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
    head = quantized.get(name)
    if max_rows <= 0 or head is None or head.qtype != "Q8_0":
        return 0
    model.lm_head_q8 = Q8Weight(*unpack_q8_0(head.data, head.shape))
    model.q8_max_rows = max_rows
    return model.lm_head_q8.nbytes


def attach_q8_embedding(model, quantized: dict) -> int:
    """Look the embedding up from the GGUF Q8_0 table as stored when the weights run in bf16, so the
    fp32 residual stream starts from the checkpoint's exact values rather than bf16-rounded ones.

    Measured on the quality guard (tests/test_kernels.py, 325 positions): top-1 agreement with the
    fp32 model went from 98.8% to 99.4% on an Intel AVX-512 machine; one gather per step, no cost per
    layer. A tied output projection already held as Q8_0 is shared, not copied.

    Returns:
        The bytes attached (0 when the embedding is not Q8_0, or is shared with the output projection).
    """
    head = quantized.get("model.embed_tokens.weight")
    if head is None or head.qtype != "Q8_0":
        return 0
    if model.lm_head is None and model.lm_head_q8 is not None:
        model.embed_q8 = model.lm_head_q8
        return 0
    model.embed_q8 = Q8Weight(*unpack_q8_0(head.data, head.shape))
    return model.embed_q8.nbytes
