"""`stratum info`: the hardware, the model's architecture and tensor types, how each projection runs
(native step, packed kernel, int4, dense) and why, the numerics rule's inputs and result, and the
kernel plan `stratum serve` would run with."""

from __future__ import annotations

import json
import os
import sys


def print_info(args) -> int:
    """The hardware, and the kernel plan `stratum serve` would run each model with; for each model, its
    architecture, tensor types and what runs packed (and why not, where not). One model (FILE, or one
    --model) is reported at the top level; several (--model repeated, NAME=MODEL, --models-dir) under
    `models`, each with its served name, as `stratum serve` would serve them."""
    import platform

    import torch

    from stratum.kernels import native
    from stratum.kernels.cpu import cpu_flags, cpu_name

    flags = cpu_flags()
    info = {
        "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available(),
        "native_kernels": native.status(),
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    try:
        named = _named_models(args)
    except (ValueError, OSError) as e:  # PullError: a model not pulled, a path that does not exist
        print(f"error: {e}", file=sys.stderr)
        return 1
    reports = [{"name": name, **_model_info(args, model)} for name, model in named]
    if len(reports) == 1:
        info.update({k: v for k, v in reports[0].items() if k != "name"})
    else:
        info["models"] = reports
    print(json.dumps(info, indent=2))
    errors = [r["plan_error"] for r in reports if "plan_error" in r]
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def _named_models(args) -> list[tuple[str, str]]:
    """(served name, model) for FILE, else each --model (NAME=MODEL too), then what --models-dir holds."""
    from pathlib import Path

    from stratum.server.models import parse_model_arg, scan_models_dir

    if args.file:
        return [(args.file, args.file)]
    entries = args.model or ([] if args.models_dir else ["smollm2-135m"])
    named = [(name or model, model) for name, model in map(parse_model_arg, entries)]
    for folder in args.models_dir or []:
        named += [(n, m) for n, m in scan_models_dir(Path(folder)) if all(n != k for k, _ in named)]
    return named


def _model_info(args, model: str) -> dict:
    """One model's report: its checkpoint, the engine serve would build, the numerics rule and the kernel
    plan; `plan_error` where it cannot be served."""
    from dataclasses import asdict

    from stratum.engine import builder
    from stratum.engine.config import EngineConfig
    from stratum.kernels.numerics import ACTIVATION_AGREEMENT
    from stratum.models.bert import EncoderCheckpoint
    from stratum.models.registry import PullError

    config = EngineConfig(model=model, num_threads=args.threads, serving=True, remeasure_plan=args.remeasure,
                          dtype=args.dtype, activations=args.activations)
    try:
        checkpoint = builder.load(config)
        if isinstance(checkpoint, EncoderCheckpoint):  # PyTorch's step: no numerics rule or kernel plan
            return {"model": model, "encoder": _encoder_info(config, checkpoint)}
        resolved = builder.resolve(config, checkpoint)
        inputs = builder.rule_inputs(config, checkpoint, resolved.device)
    except (PullError, ValueError) as e:  # ModelLoadError names the unsupported architecture or tensor type
        return {"model": model, "plan_error": str(e)}
    info: dict = {"model": model, "checkpoint": _checkpoint_info(checkpoint, resolved)}
    info["engine"] = {"device": resolved.device, "dtype": resolved.dtype, "threads": resolved.num_threads,
                      "prefill_threads": resolved.prefill_threads, "max_model_len": resolved.max_model_len,
                      "kv_blocks": resolved.num_kv_blocks,
                      "kv_tokens": resolved.num_kv_blocks * resolved.block_size}
    # the rule (kernels/numerics.py) from its inputs, then the speed choices that keep its numerics
    info["numerics"] = {"inputs": asdict(inputs), "result": resolved.numerics.describe(),
                        "activations": ACTIVATION_AGREEMENT}
    info["kernel_plan"] = resolved.kernel_plan.describe()
    return info


def _encoder_info(config, checkpoint) -> dict:
    """What an encoder serves (`engine.encoder.EncoderCore`): its tasks, pooling, vector and context."""
    from stratum.engine.encoder import EncoderCore

    info = EncoderCore(config, checkpoint).info()
    c = info.config
    return {"architecture": info.model_facts["architecture"], "tasks": list(info.tasks), "pooling": info.pooling,
            "normalized": checkpoint.config.pooling.normalize, "embedding_size": info.embedding_size,
            "max_model_len": c.max_model_len, "device": c.device, "threads": c.num_threads,
            "parameters": info.model_facts["num_parameters"], "step": "PyTorch, float32"}


def _checkpoint_info(checkpoint, resolved) -> dict:
    """The model's architecture, its file's tensor types, and how each projection and each quantized
    tensor runs once built (native step, int4, the packed kernel, or dequantized to dense): read off
    the model `build_model` makes, so it says what serving would run."""
    from collections import Counter
    from dataclasses import fields

    from stratum.engine import builder
    from stratum.engine.builder import attention_path
    from stratum.kernels import native
    from stratum.layers.linear import Linear
    from stratum.models.config import rope_type
    from stratum.models.loader import tensor_types

    cfg = checkpoint.config
    stored = {name: q.qtype for name, q in checkpoint.quantized.items()}
    options = ("tie_word_embeddings", "attention_bias", "qk_norm", "hidden_act", "embedding_scale",
               "sandwich_norms", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
               "sliding_window", "rope_local_theta")
    features = {f.name: getattr(cfg, f.name) for f in fields(cfg)
                if f.name in options and getattr(cfg, f.name) != f.default}
    if cfg.rope_scaling:
        features["rope_scaling"] = rope_type(cfg.rope_scaling)
    if any(cfg.sliding_layers):
        features["sliding_layers"] = [i for i, s in enumerate(cfg.sliding_layers) if s]
    model, _ = builder.build_model(resolved, checkpoint)
    forms = model.weight_forms  # how each quantized tensor runs: native step, int4, packed kernel, dense, rows
    dense_dtype = f"dense {resolved.dtype}"
    runs: Counter = Counter()
    for i, layer in enumerate(model.layers):
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                parts = [f"model.layers.{i}.{p}" for p in _parts(name)]
                runs[" + ".join(sorted({f"{stored.get(p, 'dense')}: {forms.get(p, dense_dtype + ' as stored')}"
                                        for p in parts}))] += 1
    head = "lm_head.weight" if model.lm_head is not None else "model.embed_tokens.weight"
    head_run = forms.get(head, dense_dtype)
    runs[f"output projection ({stored.get(head, 'dense')}): {head_run}"] += 1
    by_type: dict[str, Counter] = {}
    for name, qtype in stored.items():
        by_type.setdefault(qtype, Counter())[forms.get(name, "unused")] += 1
    dense_from = sorted(q for q, c in by_type.items() if any(h.startswith("dense") for h in c))
    return {
        "architecture": cfg.architecture, "name": cfg.name, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
        "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab": cfg.vocab_size,
        "features": features,
        "tensor_types": tensor_types(checkpoint.path),
        "step": "native (packed blocks)" if model.packed is not None else "pytorch",
        "native_step_refused": model.packed_refusal,
        "projections": dict(runs),
        "quantized_tensors": {q: dict(c) for q, c in sorted(by_type.items())},
        "dequantized_to_dense": dense_from,
        "attention": attention_path(model, resolved.device == "cpu" and native.available()),
        "speculative_decoding": _speculation(resolved.numerics, model),
        "reasoning": _reasoning(checkpoint),
    }


def _reasoning(checkpoint) -> str:
    """Whether the model reasons, as its chat template says, and how its thought is told from its answer."""
    from stratum.models.chat_template import ChatTemplate

    markers = ChatTemplate(checkpoint.chat_template, checkpoint.tokenizer).thought_markers
    if markers is None:
        return "none: the chat template writes no thought markers"
    switch = ("; thinking off renders the template with enable_thinking=false" if markers.has_switch else
              "; thinking off closes the thought in the prompt")
    return (f"the thought between {markers.start} and {markers.end}, returned apart from the answer "
            f"(serve --reasoning-format none: left in the text){switch}")


def _speculation(numerics, model) -> str:
    from stratum.engine.spec_decode import verify_refusal

    why = verify_refusal(numerics, model)
    return f"off: {why}" if why else "verified on the native step (serve --speculative auto by default)"


def _parts(fused: str) -> list[str]:
    from stratum.kernels.packed import FUSED

    return [f"{p}.weight" for p in FUSED.get(fused, (fused,))]
