"""Settings + checkpoint -> a resolved configuration (`resolve`: the numerics by their rule, then the
speed choices, context, KV blocks, sampling defaults), a model whose weights are held in the forms
the numerics name (`build_model`), and the two with a runner and its KV pool (`build` -> `Built`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from stratum.engine import weight_cache
from stratum.engine.config import (
    EngineConfig, ResolvedConfig, configured_threads, default_prefill_threads, default_threads,
    host_free_memory,
)
from stratum.engine.model_runner import ModelRunner
from stratum.home import stratum_home
from stratum.kernels import KernelPlan, PlanSource, native
from stratum.kernels import numerics as rule
from stratum.kernels.cpu import cpu_flags, cpu_name
from stratum.kernels.numerics import ACTIVATION_BITS, INT4, NATIVE, PACKED, Numerics, RuleInputs
from stratum.kernels.packed import (
    FUSED, PACKED_QTYPES, PackedSegments, PackedStack, PackedWeight, native_form, native_lookup,
)
from stratum.kernels.packed import native_step_refusal, pack_fused
from stratum.kernels.packed import LAYOUT_VERSION as PACKED_LAYOUT
from stratum.kernels.packed import pack as packed_weight
from stratum.kernels.plan import Shapes, select_plan
from stratum.kernels.quant import (
    DenseWeight, Int4Weight, Int8Weight, Parts, Q8Weight, RecentRows, unpack_q4, unpack_q8_0,
)
from stratum.layers.linear import Linear
from stratum.models.llama import LlamaForCausalLM
from stratum.models.loader import Checkpoint, load_checkpoint, release_pages
from stratum.models.registry import resolve_model_path, sampling_defaults

log = logging.getLogger("stratum.engine")

HEAD_ROWS = 16384  # rows of the output projection packed at a time: 27 MB of a 2048-wide Q6_K

# The KV pool when none is asked for (`kv_pool_blocks`): room for KV_POOL_TOKENS tokens (16 sequences
# of 1,024), or the model's whole context up to twice that, within a quarter of the memory free when the
# engine starts, and never less than KV_POOL_MIN_MB. A pool of a fixed size held 5,700 tokens of the
# 135 M model but 1,168 of a 3 B one (fp32 K and V, 229 KB a token): 6 sequences of 175 tokens, so a
# c=16 load queued behind them. The pool is anonymous memory (`model_runner._zeros`): the blocks no
# sequence has written cost nothing.
KV_POOL_TOKENS = 16384
KV_POOL_MIN_MB = 256

# the CPU features the native kernels compile to (kernels/native.py): shown among the rule's inputs
SIMD_FEATURES = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                 "asimd"}


def load(config: EngineConfig) -> Checkpoint:
    """The checkpoint, at the context asked for (ContextLengthError where the model cannot reach it)."""
    from stratum.models.bert import EncoderCheckpoint

    checkpoint = load_checkpoint(resolve_model_path(config.model))
    if isinstance(checkpoint, EncoderCheckpoint) and not config.encoder_takes_context:
        return checkpoint
    checkpoint.config = checkpoint.config.with_context(config.max_model_len, config.rope_scaling, config.rope_scale,
                                                       config.yarn_orig_ctx)
    return checkpoint


def rule_inputs(config: EngineConfig, checkpoint: Checkpoint, device: str, load_native: bool = True) -> RuleInputs:
    """What the numerics rule reads. On the CPU it loads the native kernels (compiling them once), unless
    told not to (`load_native=False`: a cold start's provisional step must not wait for a compile)."""
    quantized = checkpoint.quantized
    return RuleInputs(device, config.dtype, config.native_step, config.int4_max_tokens,
                      tuple(sorted({t.qtype for t in quantized.values()})),
                      native_step_refusal(checkpoint.config, quantized),
                      device == "cpu" and load_native and native.available(),
                      tuple(sorted(cpu_flags() & SIMD_FEATURES)),
                      config.activations)


def resolve(config: EngineConfig, checkpoint: Checkpoint, measure: bool = True,
            defer: bool = False) -> ResolvedConfig | None:
    """Every "auto" of config, decided once for this machine and this checkpoint.

    The numerics follow their rule; the threads of the native step follow the kernel plan, cached, or
    measured now where none is (with `measure`; else the CPU family's defaults). With `defer`, None
    where the native kernels would have to be compiled first: a cold start then serves on
    `provisional` meanwhile.
    """
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if defer and device == "cpu" and not native.is_built():
        return None
    numerics = rule.choose_numerics(rule_inputs(config, checkpoint, device), checkpoint.identity)
    numerics = replace(numerics, platform=_platform(numerics))
    return _resolved(config, checkpoint, numerics, _plan(config, checkpoint, numerics, measure))


def provisional(config: EngineConfig, checkpoint: Checkpoint) -> ResolvedConfig:
    """What a cold start serves on while the native kernels are compiled (`engine.prepare`): the
    PyTorch layers on int4 copies where the format allows (`numerics.provisional`), nothing measured."""
    inputs = rule_inputs(config, checkpoint, "cpu", load_native=False)
    numerics = rule.provisional(inputs, checkpoint.identity)
    numerics = replace(numerics, platform=_platform(numerics))
    threads = config.num_threads or default_threads(config.serving)
    return _resolved(config, checkpoint, numerics, KernelPlan("cpu", threads, cpu_name(), source=PlanSource.RULE,
                                                              basis="a cold start's provisional step"))


def kv_bytes_per_token(mc, kv_dtype: str) -> int:
    """One token's K and V over every layer in the pool's dtype (bf16: 2 bytes, else fp32: 4)."""
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * (2 if kv_dtype == "bfloat16" else 4)


def kv_pool_blocks(memory_mb: int | None, per_block: int, block_size: int, max_model_len: int, device: str) -> int:
    """The KV pool's blocks: memory_mb's worth, or where None, the default (KV_POOL_TOKENS above)."""
    if memory_mb is None:
        tokens = max(KV_POOL_TOKENS, min(max_model_len, 2 * KV_POOL_TOKENS))
        wanted = -(-tokens // block_size) * per_block
        memory = max(KV_POOL_MIN_MB * 2**20, min(wanted, free_memory(device) // 4))
    else:
        memory = memory_mb * 2**20
    return max(16, memory // per_block)


def free_memory(device: str) -> int:
    """Bytes free for the KV pool: the GPU's free memory; on the CPU the system's available memory, or
    what this process's memory cgroup still allows where that is less (`config.host_free_memory`)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return host_free_memory()


def _platform(numerics: Numerics) -> str:
    """What else changes the bits of the step: nothing for the native step (every SIMD path and thread
    count gives the same, tests/test_simd_paths.py); PyTorch's matmuls pick kernels by torch version
    and instruction set."""
    if numerics.step == NATIVE:
        return ""
    capability = torch.backends.cpu.get_cpu_capability() if numerics.device == "cpu" else numerics.device
    return f"torch {torch.__version__} {capability}"


def _resolved(config: EngineConfig, checkpoint: Checkpoint, numerics: Numerics, plan: KernelPlan) -> ResolvedConfig:
    mc = checkpoint.config
    threads = plan.threads
    prefill_threads = config.prefill_threads or default_prefill_threads(threads, config.replicas)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    per_block = kv_bytes_per_token(mc, numerics.kv_dtype) * config.block_size
    num_blocks = config.num_kv_blocks or kv_pool_blocks(config.kv_cache_memory_mb, per_block, config.block_size,
                                                        max_model_len, numerics.device)
    defaults = sampling_defaults(config.model)
    return ResolvedConfig(
        model=config.model, device=numerics.device, dtype=numerics.dtype, block_size=config.block_size,
        num_kv_blocks=num_blocks, max_model_len=max_model_len, enable_prefix_cache=config.enable_prefix_cache,
        num_threads=threads, prefill_threads=prefill_threads, kernel_plan=plan, seed=config.seed,
        scheduler=config.scheduler, default_temperature=defaults.get("temperature", 1.0),
        default_top_p=defaults.get("top_p", 1.0), numerics=numerics,
    )


def _plan(config: EngineConfig, checkpoint: Checkpoint, numerics: Numerics, measure: bool) -> KernelPlan:
    """The speed choices: the native step's threads from the kernel plan; elsewhere by rule, since
    the PyTorch step's fp32 matmuls may sum in another order at another thread count."""
    configured = configured_threads(config.num_threads)
    if configured:
        return KernelPlan(numerics.device, configured, cpu_name(), source=PlanSource.CONFIGURED,
                          basis="set by the user")
    threads = default_threads(config.serving, native_step=numerics.step == NATIVE)
    if numerics.step != NATIVE:
        return KernelPlan(numerics.device, threads, cpu_name(), source=PlanSource.RULE, basis="config.default_threads")
    # the rule's count (every core) is the plan's default and the most it tries
    return select_plan(stratum_home(), Shapes.of(checkpoint.config, checkpoint.quantized), threads,
                       remeasure=config.remeasure_plan, measure=measure)


def build_model(config: ResolvedConfig, checkpoint: Checkpoint) -> tuple[LlamaForCausalLM, int]:
    """The model on its device, its weights in the forms `config.numerics` names.

    The checkpoint's quantized tensors are never all dequantized: the native step runs them as stored;
    the PyTorch step holds each projection as the numerics say (`attach_quantized`), dequantizing one
    tensor at a time only what no kernel here takes (with a warning). Takes the checkpoint's tensors
    (it is empty afterwards). Returns (model, bytes of packed weights).
    """
    numerics = config.numerics
    quantized = checkpoint.quantized
    model = LlamaForCausalLM(checkpoint.config, max_positions=config.max_model_len)
    model.load_weights(checkpoint.weights, config.torch_dtype, held=set(quantized))
    model.cast_weights(config.torch_dtype)
    checkpoint.weights.clear()  # the model holds them now
    model.packed_refusal = native_step_refusal(checkpoint.config, quantized)
    if model.packed_refusal is not None and quantized:
        log.warning("%s: the native step does not run this model: %s", checkpoint.config.name, model.packed_refusal)
    if numerics.step == NATIVE:
        if not attach_packed(model, quantized, checkpoint.cache_dir):
            raise RuntimeError(f"{checkpoint.config.name}: the native step cannot hold these weights")
        quantized.clear()
        quantize_activations(model, ACTIVATION_BITS[numerics.activations])
        return model.eval(), model.packed.nbytes
    held = attach_quantized(model, quantized, numerics, checkpoint.cache_dir, lookup_rows=numerics.device == "cpu")
    model = model.to(device=torch.device(numerics.device)).eval()
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    if numerics.low_latency_head == "int8" and head.numel():  # the output projection a request may trade for speed
        model.lm_head_int8 = Int8Weight(head)
    quantized.clear()
    return model, held


@dataclass
class Built:
    """An engine's model on its kernels: the configuration, the model built on it, the bytes of its
    packed weights, and the runner with its KV pool. A kernel switch replaces it whole."""

    config: ResolvedConfig
    model: LlamaForCausalLM
    packed_bytes: int
    runner: ModelRunner

    def kernel_choices(self, speculative: dict, preparing: bool) -> dict:
        """What runs the model, for `EngineInfo` and `stratum info`; preparing: a cold start's kernels
        are being prepared behind this provisional step."""
        plan, numerics, model = self.config.kernel_plan, self.config.numerics, self.model
        on_cpu = self.config.device == "cpu"
        return {"numerics": numerics.key(), "dtype": numerics.dtype, "kv_dtype": numerics.kv_dtype,
                "activations": numerics.activations,
                "packed_mb": round(self.packed_bytes / 2**20, 1),
                "low_latency_lm_head": "int8" if model.lm_head_int8 is not None else None,
                "threads": plan.threads,
                "native_kernels": ("being prepared" if preparing else native.status()) if on_cpu else "cpu only",
                "step": "native, packed blocks" if model.packed is not None else "pytorch",
                "native_step_refused": model.packed_refusal,
                "step_simd": native.simd_path() if model.packed is not None else None,
                "attention": attention_path(model, self.runner.native),
                "speculative": speculative,
                "source": plan.source}


def build(config: ResolvedConfig, checkpoint: Checkpoint, use_native: bool = True) -> Built:
    """The model for config and a runner with its KV pool (use_native False: a cold start's
    provisional step, which must not wait for the native kernels to compile)."""
    model, packed_bytes = build_model(config, checkpoint)
    runner = ModelRunner(model, config.num_kv_blocks, config.block_size, torch.device(config.device),
                         config.torch_kv_dtype, use_native=use_native)
    return Built(config, model, packed_bytes, runner)


def attention_path(model, native_decode: bool) -> str:
    """How attention runs for `model`; native_decode: the native decode kernel is built (a runner on
    the CPU with the native kernels loaded)."""
    if model.packed is not None:
        return "native paged, every row"
    if model.config.has_masked_attention:  # layers.attention: sliding windows and soft-caps on PyTorch
        return "pytorch paged gather, masked (sliding window / soft-cap), no cascade"
    return ("native paged decode" if native_decode else "paged gather") + " + cascade, torch sdpa prefill"


def quantize_activations(model, bits: int) -> None:
    """The native step and its output projection quantize activation blocks to `bits` (16 or 8)."""
    model.packed.activation_bits = bits
    if model.packed_head is not None:
        model.packed_head.activation_bits = bits


def attach_packed(model, quantized: dict, cache_dir: Path | None = None) -> bool:
    """Run every layer through the native step on the checkpoint's own blocks, when each projection
    is in one of PACKED_QTYPES (and the output projection too, when it is).

    The repacked blocks are kept in cache_dir/packed-<layout version>-head-rows.bin when a cache is given,
    written a layer at a time (each layer's GGUF pages let go of once it is packed) and mapped from
    there, then and at later starts: repacking takes seconds at every start otherwise, and held in
    memory it would double what the weights cost. The projections' dense weights stay empty (a
    dense file's are dropped): the step never reads them.
    The embedding is looked up from its blocks as stored where it is quantized, and the output
    projection runs on the same kernel for every row, so a token's logits do not depend on the batch
    around it.

    Returns:
        Whether the step was attached (False: some projection is in another format).
    """
    name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
    n = model.config.num_layers
    parts = [[f"model.layers.{i}.{p}.weight" for p in fused] for i in range(n) for fused in FUSED.values()]
    if any(p not in quantized or quantized[p].qtype not in PACKED_QTYPES for names in parts for p in names):
        return False
    head = quantized.get(name)
    head = head if head is not None and head.qtype in PACKED_QTYPES else None

    def pack_layer(i: int) -> list:
        """Layer i's projections as the step's segments, its GGUF blocks then let go of."""
        projections = [pack_fused(quantized, f"model.layers.{i}.", fused) for fused in FUSED.values()]
        for names in parts[i * len(FUSED) : (i + 1) * len(FUSED)]:
            for p in names:
                quantized[p].release()
        trim_heap()  # the previous layer's buffers, freed
        return [[w.saved() for w in segments] for segments in projections]

    def head_rows(start: int) -> list:
        """Rows [start, start + HEAD_ROWS) of the output projection, packed; their GGUF pages let go of
        (a tied embedding's rows are read back one at a time, at lookup)."""
        rows = min(HEAD_ROWS, head.shape[0] - start)
        w = packed_weight(head.qtype, head.data[start : start + rows], (rows, head.shape[1])).saved()
        release_pages(head.stored[start : start + rows])
        trim_heap()
        return w

    # the output projection in segments of rows: a large vocabulary's is never all in memory at once
    head_keys = [(f"head.{r}", lambda r=r: head_rows(r)) for r in range(0, head.shape[0], HEAD_ROWS)] if head else []
    cache = cache_dir / f"packed-{PACKED_LAYOUT}-head-rows" if cache_dir is not None else None
    saved = weight_cache.cached(cache, [*head_keys, *((f"layers.{i}", lambda i=i: pack_layer(i)) for i in range(n))])
    head_parts = [PackedWeight(*saved[key]) for key, _ in head_keys]
    saved = {"layers": [saved[f"layers.{i}"] for i in range(n)],
             "head": PackedSegments(head_parts) if head_parts else None}
    model.packed = PackedStack(model, [[[PackedWeight(*w) for w in segments] for segments in projections]
                                       for projections in saved["layers"]])
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                module.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    model.weight_forms.update({n: native_form(q.qtype) for n, q in quantized.items() if n.startswith("model.layers.")})
    if saved["head"] is not None:  # the same kernel for every row: its segments' outputs side by side
        model.packed_head = saved["head"]
        model.weight_forms[name] = native_form(quantized[name].qtype)
    attach_embedding(model, quantized)
    if model.lm_head is not None and model.packed_head is not None:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    trim_heap()
    return True


def trim_heap() -> None:
    """Give the heap's freed memory back to the system (glibc malloc_trim). Buffers of a few MB freed
    while converting stay in the process otherwise (glibc raises its mmap threshold as they are
    freed): 137 MB of a 1 B model's first start, measured."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# a fused projection's parts held alike: (cache key, form, the checkpoint's tensors)
Group = tuple[str, str, list]


def attach_quantized(model, quantized: dict, numerics: Numerics, cache_dir: Path | None = None,
                     lookup_rows: bool = True) -> int:
    """Fill every projection, the output projection and the embedding the model left empty (their
    tensors are quantized) from the checkpoint's blocks, each in the form `numerics` names for its
    type; the parts of a fused projection each on their own kernel where their forms differ. A
    quantized embedding is looked up from its blocks row by row (`lookup_rows`, on CPU), else
    dequantized too. Records how each quantized tensor runs (`model.weight_forms`, for `stratum
    info`), and warns where any was dequantized.

    Packed forms are kept in cache_dir/held-<layout version>.bin when a cache is given (converting
    takes seconds per billion weights), written one projection at a time and mapped from there.

    Returns:
        The bytes of packed weights attached.

    Raises:
        KeyError: a projection is neither in the file's dense tensors nor among its quantized ones.
    """
    if lookup_rows:
        attach_embedding(model, quantized)
    targets = _targets(model, quantized, numerics)
    dtype = getattr(torch, numerics.dtype)
    makers = [(key, lambda f=form, ts=tensors: _convert(f, ts, dtype)) for gs, _ in targets for key, form, tensors in gs
              if form in (INT4, PACKED)]
    # int4 copies keep their scales in the activations' dtype: the cache is one per dtype
    cache = cache_dir / f"held-{PACKED_LAYOUT}-{numerics.dtype}" if cache_dir is not None else None
    converted = weight_cache.cached(cache, makers) if makers else {}
    for gs, place in targets:
        ws = [_held(group, converted) for group in gs]
        place(ws[0] if len(ws) == 1 else Parts([DenseWeight(w) if isinstance(w, torch.Tensor) else w for w in ws]))
    embed = quantized.get("model.embed_tokens.weight")
    if embed is not None and not model.embed_tokens.weight.numel() and model.embed_table is None:
        model.weight_forms["model.embed_tokens.weight"] = form = numerics.form(embed.qtype)
        _put(model.embed_tokens, embed.dense(_dense_dtype(form) if form.startswith(rule.DENSE) else dtype))
    _warn_dense(model, quantized)
    return sum(m.quantized.nbytes for m in model.modules() if isinstance(m, Linear) and m.quantized is not None) + (
        model.packed_head.nbytes if model.packed_head is not None else 0)


def _targets(model, quantized: dict, numerics: Numerics) -> list[tuple[list[Group], Callable]]:
    """What to fill: per projection left empty, its parts' groups and where its weight goes."""
    forms: dict[str, str] = model.weight_forms

    def groups(key: str, names: list[str]) -> list[Group]:
        """One group per run of consecutive parts of one form (and format, for the native kernel)."""
        out: list[Group] = []
        for n in names:
            t = quantized[n]
            forms[n] = form = numerics.form(t.qtype)
            if out and out[-1][1] == form and (form != PACKED or out[-1][2][0].qtype == t.qtype):
                out[-1][2].append(t)
            else:
                out.append((f"{key}.{len(out)}.{'int4' if form == INT4 else 'packed'}", form, [t]))
        return out

    def put_head(w) -> None:
        if isinstance(w, torch.Tensor):
            _put(model.lm_head if model.lm_head is not None else model.embed_tokens, w)
        else:
            model.packed_head = w

    targets: list[tuple[list[Group], Callable]] = []
    for i, layer in enumerate(model.layers):
        for fused, parts in FUSED.items():
            module: Linear = layer.get_submodule(fused)
            if not module.weight.numel():  # else dense in the file
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                targets.append((groups(f"layers.{i}.{fused}", names), lambda w, m=module: _put(m, w)))
    head_name = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
    if quantized.get(head_name) is not None:
        targets.append((groups("head", [head_name]), put_head))
    return targets


def _convert(form: str, tensors: list, dtype: torch.dtype) -> list:
    """Parts of one packed form as one weight's fields (int4: for activations in `dtype`); their
    GGUF pages are let go of after."""
    if form == INT4:
        unpacked = [unpack_q4(t.qtype, t.data, t.shape) for t in tensors]
        w = Int4Weight(*(torch.cat([u[j] for u in unpacked]) for j in range(3)), dtype=dtype)
        fields = [w.packed, w.scale_zeros, w.out_features, w.in_features]
    else:
        raw = np.concatenate([np.asarray(t.data).reshape(t.shape[0], -1) for t in tensors])
        fields = list(packed_weight(tensors[0].qtype, raw,
                                    (sum(t.shape[0] for t in tensors), tensors[0].shape[1])).saved())
    for t in tensors:
        t.release()
    return fields


def _held(group: Group, converted: dict):
    """A group's weight: its packed form from `converted`, or its tensors dequantized."""
    key, form, tensors = group
    if form == INT4:
        return Int4Weight.from_packed(*converted[key])
    if form == PACKED:
        return PackedWeight(*converted[key])
    w = torch.cat([t.dense(_dense_dtype(form)) for t in tensors])
    for t in tensors:
        t.release()
    return w


def _dense_dtype(form: str) -> torch.dtype:
    return getattr(torch, form.split()[-1])


def _put(module, w) -> None:
    if isinstance(w, torch.Tensor):
        module.weight = torch.nn.Parameter(w, requires_grad=False)
    else:
        module.quantized = w


def _warn_dense(model, quantized: dict) -> None:
    """Says what was dequantized, by form and type: memory the user may not have planned for."""
    dense: dict[str, dict[str, int]] = {}
    for n, form in model.weight_forms.items():
        if form.startswith(rule.DENSE):
            by_type = dense.setdefault(form, {})
            by_type[quantized[n].qtype] = by_type.get(quantized[n].qtype, 0) + 1
    for form, by_type in dense.items():
        log.warning("%s: dequantized to %s (no packed kernel here runs them, or the settings asked for dense "
                    "weights): %s", model.config.name, form,
                    ", ".join(f"{n} {q} tensors" for q, n in sorted(by_type.items())))


def attach_embedding(model, quantized: dict) -> int:
    """Look a quantized embedding up from its blocks as stored, row by row, exactly (every stored
    type's values are exact in fp32): no dense copy, and the fp32 residual stream starts from the
    checkpoint's own values. Q8_0 rows are read from an int8 copy (a gather per step), others
    dequantized at lookup: by the native library where it is loaded (~25 us a step), else by gguf-py
    with the recent rows kept (RecentRows). A tied output projection held as Q8_0 is not copied twice.

    Returns:
        The bytes attached for it.
    """
    embed = quantized.get("model.embed_tokens.weight")
    if embed is None or model.embed_table is not None:
        return 0
    model.weight_forms.setdefault("model.embed_tokens.weight", "rows dequantized at lookup")
    if embed.qtype != "Q8_0":
        model.embed_table = embed if native_lookup(embed.qtype) else RecentRows(embed)
        return 0
    model.embed_table = Q8Weight(*unpack_q8_0(embed.data, embed.shape))
    return model.embed_table.nbytes
