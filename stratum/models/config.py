"""The architecture description every loader produces and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Hugging Face model_type -> the family name used here (and by GGUF's general.architecture).
HF_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "phi3": "phi3"}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
GEMMA = ("gemma2", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")  # what layers/rotary.py computes
CONTEXT_SCALINGS = ("linear", "yarn")  # what --rope-scaling may name (llama.cpp's --rope-scaling)


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature this runtime does not compute; the message names it."""


class ContextLengthError(ValueError):
    """A context length the model was not trained for, asked without a RoPE scaling that reaches it."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder of one of SUPPORTED_ARCHITECTURES.

    Llama is the base; each family switches on what it adds:
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3).
        rope_scaling: None, or a dict with "rope_type" ("llama3", "linear", "freq_factors") and its parameters.
        sliding_window / sliding_layers: layer i attends only to the last `sliding_window` positions
            (itself included) where sliding_layers[i] (Mistral, Phi-3, Gemma 2/3; Qwen with use_sliding_window).
        rope_local_theta: the RoPE base of the sliding layers, unscaled (Gemma 3); None: the global one.
        Gemma 2/3: gelu-tanh MLP (hidden_act), embeddings scaled by sqrt(hidden) (embedding_scale), norms
            around both attention and MLP (sandwich_norms), attention scale query_pre_attn_scalar ** -0.5,
            and tanh soft-capping of attention scores and final logits (cap * tanh(x / cap)).
    Norm weights are multipliers: Gemma's stored (w) is turned into (1 + w) by the loader, as llama.cpp's
    converter stores it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    embedding_scale: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None  # None: head_dim
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to its whole context."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    @property
    def has_masked_attention(self) -> bool:
        """Some layer needs more than causal attention: a sliding window or soft-capped scores."""
        return any(self.sliding_layers) or self.attn_logit_softcap is not None

    def check(self) -> "ModelConfig":
        """Raises UnsupportedModelError for what the model cannot compute; returns self."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {self.architecture!r} is not supported "
                                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        kind = rope_type(self.rope_scaling)
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"{self.architecture}: RoPE scaling {kind!r} is not supported "
                                        f"(supported: {', '.join(ROPE_TYPES)})")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"{self.architecture}: activation {self.hidden_act!r} is not supported")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(f"{self.architecture}: {len(self.sliding_layers)} layer types "
                                        f"for {self.num_layers} layers")
        return self

    def with_context(self, max_model_len: int | None, scaling: str | None = None, factor: float | None = None,
                     original: int | None = None) -> "ModelConfig":
        """The model at the context a user asked for (`stratum serve --max-model-len`, `--rope-scaling`,
        `--rope-scale`, `--yarn-orig-ctx`, as llama.cpp names them).

        Without `scaling` the context is at most the trained one (`max_position_embeddings`): a longer one
        is refused, never served silently at another length. With it, RoPE positions are scaled by
        `factor` (default: max_model_len / the trained context) from the `original` context (default the
        trained one): "linear" divides every frequency (position interpolation), "yarn" interpolates the
        low frequencies only and scales attention (`layers.rotary.rope_inv_freq`); the context is then
        up to original x factor.

        Raises:
            ContextLengthError: the asked context is beyond what the model (so scaled) reaches, or the
                scaling is asked for a model that already has one.
        """
        trained = self.max_position_embeddings
        if scaling in (None, "none"):
            if max_model_len is not None and max_model_len > trained:
                raise ContextLengthError(
                    f"--max-model-len {max_model_len} is beyond {self.name or 'the model'}'s trained context "
                    f"of {trained} tokens: serve at most {trained}, or extend it explicitly with --rope-scaling "
                    f"yarn (or linear), e.g. --max-model-len {max_model_len} --rope-scaling yarn")
            return self
        if scaling not in CONTEXT_SCALINGS:
            raise ContextLengthError(f"--rope-scaling {scaling!r}: expected one of none, {', '.join(CONTEXT_SCALINGS)}")
        if rope_type(self.rope_scaling) != "default":
            raise ContextLengthError(f"{self.name or 'the model'} already scales RoPE "
                                     f"({rope_type(self.rope_scaling)}); "
                                     "--rope-scaling cannot be applied over it")
        base = original or trained
        factor = factor or (max_model_len / base if max_model_len else None)
        if not factor or factor <= 1.0:
            raise ContextLengthError(f"--rope-scaling {scaling} needs --rope-scale above 1, or a --max-model-len above "
                                     f"the {base}-token context it extends")
        reach = int(base * factor)
        if max_model_len is not None and max_model_len > reach:
            raise ContextLengthError(f"--max-model-len {max_model_len} is beyond the {reach} tokens that --rope-scale "
                                     f"{factor:g} reaches from {base}")
        rope = {"rope_type": scaling, "factor": float(factor), "original_max_position_embeddings": base}
        return replace(self, rope_scaling=rope, max_position_embeddings=max_model_len or reach)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dictionary (transformers 4 or 5 layouts).

        Raises:
            KeyError: a required field is missing. UnsupportedModelError: see `check`.
        """
        model_type = cfg.get("model_type", "llama")
        arch = HF_FAMILIES.get(model_type, model_type)
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta, rope_scaling, local_theta = _hf_rope(cfg, arch)
        gemma = arch in GEMMA
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch in ("qwen3", "gemma3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            hidden_act="gelu_pytorch_tanh" if act in ("gelu_pytorch_tanh", "gelu_tanh") else act,
            embedding_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            sandwich_norms=gemma,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            sliding_window=cfg.get("sliding_window"),
            sliding_layers=_hf_sliding_layers(cfg, arch, num_layers),
            rope_local_theta=local_theta,
        ).check()


def rope_type(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def _hf_rope(cfg: dict[str, Any], arch: str) -> tuple[float | None, dict | None, float | None]:
    """(theta, scaling or None, the sliding layers' theta or None) from either transformers layout:
    4.x `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`), or 5.x `rope_parameters`,
    per layer type for Gemma 3."""
    params = cfg.get("rope_parameters")
    local = None
    if isinstance(params, dict) and "full_attention" in params:  # per layer type
        local = (params.get("sliding_attention") or {}).get("rope_theta")
        params = params["full_attention"]
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling") or None
    if isinstance(params, dict):
        theta = theta or params.get("rope_theta")
        if rope_type(params) != "default":
            scaling = scaling or params
    if arch == "gemma3":
        local = local or cfg.get("rope_local_base_freq", 10000.0)
    return theta, scaling, local


def _hf_sliding_layers(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: config `layer_types` (transformers 5) where present, else
    each family's own rule as transformers applies it."""
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    types = cfg.get("layer_types")
    if types:
        return tuple(t == "sliding_attention" for t in types)
    if arch == "gemma2":  # even layers slide
        return tuple(i % 2 == 0 for i in range(num_layers))
    if arch == "gemma3":  # every `sliding_window_pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if arch in ("qwen2", "qwen3"):
        return tuple(i >= cfg.get("max_window_layers", num_layers) for i in range(num_layers))
    return (True,) * num_layers  # Mistral, Phi-3: every layer
