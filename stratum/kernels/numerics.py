"""The numerics rule: which step, dtypes and weight forms compute a model's KV and logits, from the
file's tensor types, the CPU's features and the user's settings alone (never from a timing), so every
start of the same server on the same machine gives the same bits; `Numerics` is its record."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

# Bumped by any change to a kernel that changes a bit of the KV pool or of the logits (the native
# step, the packed projection, the PyTorch layers' numerics): what keys KV saved to disk and the
# draft/verify agreement of speculative decoding on the numerics.
KERNEL_NUMERICS_VERSION = 1

NATIVE, PYTORCH = "native", "pytorch"
# how a stored tensor type runs (Numerics.weights)
AS_STORED = "as stored, native step"  # the native step's tiles: int16 activation blocks, exact integer sums
PACKED = "packed kernel, as stored"  # the same kernel, one projection at a time, under the PyTorch layers
INT4 = "int4"  # PyTorch's int4 kernel (Q4_0 / Q4_1 / Q4_K, exact weights), activations in `dtype`
DENSE = "dense"  # dequantized once, at load, one tensor at a time: "dense float32", "dense bfloat16"

# tensor types PyTorch's int4 kernel holds exactly (kernels/quant.py) and types the native kernels run
# (kernels/packed.py PACKED_QTYPES): spelled out here so the rule imports no torch
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# the native step's activation blocks (`--activations`): the bits their integers take
ACTIVATION_BITS = {"int16": 16, "int8": 8}
# what each setting costs in top-1 agreement with the fp32 model (the file dequantized, fp32
# activations), as measured (scripts/top1_agreement.py; tests/test_kernels.py holds the default to 99%):
# `stratum info` states it beside the rule's result. int8 is not the default because it stays under
# that bound; every SIMD family computes either setting to the same bits.
ACTIVATION_AGREEMENT = {
    "int16": "the default: top-1 agreement with fp32 on SmolLM2-135M 400 of 400 positions of the README, "
             "325 of 325 of tests/test_kernels.py's corpus",
    "int8": "the user's choice, as llama.cpp: top-1 agreement with fp32 on SmolLM2-135M 385 of 400 (96.3%) "
            "and 316 of 325 (97.2%), under the 99% the default is held to; about twice the multiply-adds "
            "per instruction where the CPU's widest integer product is 8-bit (AVX2, AVX-512 VNNI)",
}
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


@dataclass(frozen=True)
class RuleInputs:
    """Everything the rule reads; `stratum info` prints it beside the result."""

    device: str  # "cpu" | "cuda"
    dtype: str  # the user's --dtype: "auto" | "float32" | "bfloat16"
    native_step: bool | None  # the user's setting: None (the rule), True, False
    int4_max_tokens: int | None  # the user's int4 setting: None (the rule), 0 (never pack), N > 0 (int4 copies)
    tensor_types: tuple[str, ...]  # the stored types of the quantized projections (and output projection), sorted
    native_refusal: str | None  # why the native step cannot compute this model (kernels.packed), or None
    native_kernels: bool  # the native kernels are loaded in this process
    cpu_features: tuple[str, ...]  # the CPU's SIMD features that decide what the native kernels compile to
    activations: str = "int16"  # the user's --activations: how the native step quantizes activation blocks


@dataclass(frozen=True)
class Numerics:
    """Everything that decides the bits of the KV pool and the logits of the running step; frozen.

    `key()` is a digest of it: two engines with equal keys write the same KV and compute the same
    logits for the same tokens. A cold start's provisional step and the native step it switches to
    (`EngineCore.switch_kernels`) have different keys: `ResolvedConfig.numerics` follows the step.
    """

    model: str  # the checkpoint's identity (loader.file_identity: path, size, modification time)
    device: str
    step: str  # NATIVE or PYTORCH
    dtype: str  # the PyTorch layers' matmul dtype ("float32" on the native step, which computes in fp32)
    kv_dtype: str
    weights: tuple[tuple[str, str], ...]  # (stored type, how it runs), sorted
    attention: str  # "native step" | "native paged decode" | "pytorch"
    low_latency_head: str | None  # "int8" where a request may ask for the lossy output projection
    platform: str = ""  # what else picks the step's kernels: torch and the instruction set (PyTorch step only)
    version: int = KERNEL_NUMERICS_VERSION
    activations: str = "int16"  # the native step's activation blocks: "int16" (the rule) or "int8" (the user's choice)

    @property
    def is_batch_invariant(self) -> bool:
        """Whether a token's KV and logits are the same whatever else is in its step (the native step:
        csrc/packed_step.cpp). PyTorch's matmuls pick kernels by the batch's size, so on the PyTorch
        step equal keys promise the same configuration, not the same bits in every batch."""
        return self.step == NATIVE

    @classmethod
    def from_dict(cls, d: dict) -> "Numerics":
        """From `describe()` or `asdict` output (another process's copy)."""
        d = {k: v for k, v in d.items() if k != "key"}
        weights = d["weights"].items() if isinstance(d["weights"], dict) else d["weights"]
        return cls(**{**d, "weights": tuple(tuple(w) for w in weights)})

    def key(self) -> str:
        """A stable hex digest of every field."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]

    def form(self, qtype: str) -> str:
        """How a tensor stored as `qtype` runs (dense in `dtype` for a type the table does not name)."""
        return dict(self.weights).get(qtype, dense(self.dtype))

    def describe(self) -> dict:
        return {**asdict(self), "weights": dict(self.weights), "key": self.key()}


def choose_numerics(inputs: RuleInputs, model: str) -> Numerics:
    """The numerics a start of `model` runs with, given `inputs`.

    On the CPU:
    - the native step wherever it can run the file (every projection in one of PACKED_QTYPES, a
      Llama-shaped family, the native kernels built): weights exactly as stored, activations quantized
      to int16 per block of 32 with exact integer block sums (kernels/packed.py), fp32 accumulation in a
      fixed order, fp32 residual stream; KV in fp32 (bf16 with `--dtype bfloat16`);
    - else the PyTorch step in fp32 (or the `--dtype` given): each quantized projection on the native
      kernel as stored (the native step's own projection numerics), where the kernels are built; int4
      copies only where the user asked for them (`int4_max_tokens`); dense in the compute dtype only
      what no kernel here takes (or everything, with `int4_max_tokens=0`);
    - with `--activations int8` (the user's choice, never the rule's) the native step quantizes its
      activation blocks to int8, as llama.cpp does: a CPU whose widest integer product is 8-bit
      (vpmaddubsw on AVX2, vpdpbusd on AVX-512 VNNI) then runs about twice the multiply-adds per
      instruction; it costs top-1 agreement with the fp32 model (316 of 325 vs 325 of 325 on
      SmolLM2). Every SIMD family still gives the same bits, since a block's integer sums are exact
      whichever instruction computes them;
    - the int8 output projection a request may ask for ("Prioritize low-latency over accuracy") exists
      only where the user chose bf16 on the PyTorch step: elsewhere no request is served lossier.
    On CUDA: the PyTorch step in bf16 (or `--dtype`), weights dense.

    Why this default: it is the fastest path whose results stay within int16 rounding of llama.cpp's
    reference dequantization (fp32 weights, fp32 activations). bf16 rounds activations and dequantized
    weights to 8 bits of mantissa, which changed greedy answers against fp32 in 5 of 7 families; the
    native step's int16 blocks keep 15 bits, finer than llama.cpp's own int8 activations (measured:
    top-1 agreement 325/325 with fp32 on SmolLM2, 97.2-97.5% with int8 activations; tests/test_kernels.py).
    """
    types = inputs.tensor_types
    if inputs.activations not in ACTIVATION_BITS:
        raise ValueError(f"--activations is one of {', '.join(ACTIVATION_BITS)}, not {inputs.activations!r}")
    native = (inputs.device == "cpu" and inputs.native_kernels and inputs.native_refusal is None
              and inputs.native_step is not False and bool(types) and inputs.int4_max_tokens in (None, 0))
    if inputs.activations != "int16" and not native:
        raise _pytorch_step_refusal(inputs)
    if inputs.device != "cpu":
        dtype = "bfloat16" if inputs.dtype == "auto" else inputs.dtype
        return Numerics(model, inputs.device, PYTORCH, dtype, dtype, tuple((t, dense(dtype)) for t in types),
                        PYTORCH, None)
    if native:
        kv = "bfloat16" if inputs.dtype == "bfloat16" else "float32"
        return Numerics(model, "cpu", NATIVE, "float32", kv, tuple((t, AS_STORED) for t in types), "native step", None,
                        activations=inputs.activations)
    dtype = "float32" if inputs.dtype == "auto" else inputs.dtype
    forms = tuple((t, _held(t, inputs, dtype)) for t in types)
    attention = "native paged decode" if inputs.native_kernels else PYTORCH
    return Numerics(model, "cpu", PYTORCH, dtype, dtype, forms, attention, "int8" if dtype == "bfloat16" else None)


def _pytorch_step_refusal(inputs: RuleInputs) -> ValueError:
    """--activations other than int16 where the start runs the PyTorch step, naming why it does."""
    if inputs.device != "cpu":
        why = f"on {inputs.device}"
    elif inputs.native_step is False:
        why = "the native step was turned off (native_step=False)"
    elif inputs.int4_max_tokens:
        why = "int4 copies were asked for"
    elif not inputs.native_kernels:
        why = "the native kernels are not built"
    else:
        why = inputs.native_refusal or "the file has no quantized projections"
    return ValueError(f"--activations {inputs.activations} quantizes the native step's activations, "
                      f"and this start runs the PyTorch step ({why})")


def dense(dtype: str) -> str:
    return f"{DENSE} {dtype}"


def _held(qtype: str, inputs: RuleInputs, dtype: str) -> str:
    """How the PyTorch step holds a projection stored as `qtype`."""
    if inputs.int4_max_tokens == 0:  # the user asked for no packed weights: the dequantized reference
        return dense(dtype)
    if inputs.int4_max_tokens and qtype in INT4_TYPES:
        return INT4
    return PACKED if inputs.native_kernels and qtype in NATIVE_TYPES else dense(dtype)


def provisional(inputs: RuleInputs, model: str) -> Numerics:
    """What a cold start serves on while the native kernels are compiled (`engine.prepare`): no native
    kernel exists yet, so Q4_0 / Q4_1 / Q4_K run on PyTorch's int4 kernel with fp32 activations and
    the other types are dequantized to bf16, one tensor at a time, so memory stays near the file's
    size. Its numerics differ from the native step's (int4's sums run in another order, without
    int16 activation blocks): answers may change at the switch, and `Numerics.key` says so. Settings
    the native step it switches to would refuse are refused now, not at the switch."""
    choose_numerics(replace(inputs, native_kernels=True), model)
    dtype = "float32" if inputs.dtype == "auto" else inputs.dtype
    forms = tuple((t, INT4 if t in INT4_TYPES else dense("bfloat16")) for t in inputs.tensor_types)
    return Numerics(model, "cpu", PYTORCH, dtype, dtype, forms, PYTORCH, None)
