"""The decoder in plain PyTorch: Llama 2/3, Mistral, SmolLM2, Qwen2/2.5, Qwen3, Gemma 2/3 and Phi-3.

Llama is the base: RMSNorm, rotate-half RoPE (with Llama 3 scaling), grouped-query attention over the
paged KV pool, SwiGLU MLP and optionally tied embeddings. The other families are options of the same
layers (`ModelConfig`), in the manner of llama.cpp's per-architecture graph builders: Qwen2 adds q/k/v
bias, Qwen3 per-head q/k norms; Mistral and Phi-3 (whose fused q/k/v and gate/up the loader splits) a
sliding window; Gemma 2/3 scaled embeddings, gelu-tanh, norms after attention and MLP too, soft-capped
attention scores and logits, sliding-window layers and (Gemma 3) q/k norms with their own RoPE base.
The forward takes a flattened varlen batch: token ids [T] and positions [T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stratum.layers.attention import AttentionMetadata, attention_coverage, paged_attention
from stratum.layers.linear import Linear
from stratum.layers.norm import RMSNorm
from stratum.layers.rotary import RotaryEmbedding, apply_rotary
from stratum.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer_idx)
        self.softcap = cfg.attn_logit_softcap
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, rope, meta: AttentionMetadata, kv_cache) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        written = meta.native and self.q_norm is None and qkv.dtype == kv_cache[0].dtype
        if written:  # rotation and the pool write in one native pass
            qk = torch.ops.stratum.rotary_cache(qkv, rope[0], rope[1], kv_cache[0], kv_cache[1], meta.slot_mapping,
                                                self.num_heads)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                           self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
            qk = apply_rotary(qk, *rope)  # q and k rotated together: one pass instead of two
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, written=written,
                            window=self.window, softcap=self.softcap)
        probe = meta.probe
        if probe is not None and self.layer_idx in probe.layers:
            for row, slots, out in zip(probe.rows, probe.slots, probe.results):
                out.append(attention_coverage(q[row], kv_cache[0].index_select(0, slots), self.scale))
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.is_sliding = cfg.layer_window(layer_idx) is not None
        # Gemma's sandwich: post_attention_layernorm normalizes the attention output, and the MLP has
        # its own norms before and after; in Llama post_attention_layernorm is the MLP's input norm
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if sandwich else None

    def forward(self, x, rope, meta, kv_cache) -> torch.Tensor:
        if self.pre_feedforward_layernorm is None:
            x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        # _weight skips the random init: every value is overwritten by load_weights
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head_int8 = None  # the lossy int8 output projection, where the numerics offer it (kernels/numerics.py)
        # the embedding table as stored (GGUF blocks, dequantized row by row at lookup): exact, and no dense copy
        self.embed_table = None
        self.packed = None  # every layer on the checkpoint's packed blocks, one native call per step (kernels.packed)
        # the output projection held in the checkpoint's blocks (the native kernel's, or int4), the
        # same kernel for every row, so a token's logits do not depend on the batch around it
        self.packed_head = None
        self.packed_refusal = None  # why the native step cannot run this model (kernels.packed), or None
        self.weight_forms: dict[str, str] = {}  # how each quantized checkpoint tensor runs (set by the engine builder)
        positions = max_positions or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3's sliding layers rotate with a base of their own, unscaled
        self.rotary_local = (RotaryEmbedding(cfg.head_dim, positions, cfg.rope_local_theta, None)
                             if cfg.rope_local_theta is not None else None)

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """Args: input_ids, positions [T]. Returns the final hidden states [T, hidden]."""
        # the residual stream stays fp32; matmuls run in the weights' dtype
        x = self.embed_table.rows(input_ids) if self.embed_table is not None else self.embed_tokens(input_ids).float()
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        if self.packed is not None:
            hidden, coverage = self.packed.forward(x, positions, self.rotary.cos, self.rotary.sin, meta, kv_caches)
            if meta.probe is not None:
                self._record_coverage(meta.probe, coverage)
            return hidden
        rope = self.rotary.tables(positions)
        local = self.rotary_local.tables(positions) if self.rotary_local is not None else rope
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, local if layer.is_sliding else rope, meta, kv_cache)
        return self.norm(x)

    @staticmethod
    def _record_coverage(probe, coverage: torch.Tensor) -> None:
        """The coverage the native step measured, [layers, rows], into the probe's results."""
        for values in coverage.tolist():
            for out, value in zip(probe.results, values):
                out.append(value)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]. fast: the int8 output projection, when one is attached.

        Every row uses the same projection: the packed one where the output projection is held in
        its blocks, else the dense weight. Soft-capped where the model caps its logits (Gemma 2).
        """
        logits = self._project(hidden, fast)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _project(self, hidden: torch.Tensor, fast: bool) -> torch.Tensor:
        if fast and self.lm_head_int8 is not None:
            return self.lm_head_int8.matmul(hidden).float()
        if self.packed_head is not None:
            return self.packed_head.matmul(hidden).float()
        if self.lm_head is None:
            w = self.embed_tokens.weight
            return F.linear(hidden.to(w.dtype), w).float()
        return self.lm_head(hidden).float()

    def cast_weights(self, dtype: torch.dtype) -> None:
        """Matmul weights and embeddings to `dtype`; norms, rotary tables and activations stay fp32."""
        for module in self.modules():
            if isinstance(module, (Linear, nn.Embedding)):
                module.to(dtype)

    def load_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                     held: frozenset[str] | set[str] = frozenset()) -> None:
        """Load tensors named as in Hugging Face Llama checkpoints (the loaders' common form: norm
        weights as multipliers, q/k/v and gate/up separate), fusing q/k/v and gate/up.

        dtype: the matmul weights' (projections, embedding) dtype, converted tensor by tensor rather
        than the whole model at once. held: names the caller provides otherwise (the checkpoint's
        quantized tensors, attached by the engine builder): a projection, embedding or output
        projection with such a part absent is left empty (no elements) for the caller to fill.

        Raises:
            KeyError: a tensor the architecture needs is missing.
        """
        cfg = self.config
        params = dict(self.named_parameters())

        def take(name: str) -> torch.Tensor | None:
            return weights.pop(name, None) if name in held else weights.pop(name)

        def put(name: str, tensor: torch.Tensor | None, matmul: bool = False) -> None:
            param = params[name]
            target = dtype if matmul and dtype is not None else param.dtype
            if tensor is None:
                param.data = torch.empty(0, dtype=target)
                return
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            # the loader's tensor itself, not a copy: the untouched empty parameter costs no memory, and
            # a float32 tensor mapped from the file stays mapped: weights are only read
            param.data = tensor.to(target).contiguous()

        def fused(names: list[str]) -> torch.Tensor | None:
            parts = [take(n) for n in names]
            return None if any(p is None for p in parts) else torch.cat(parts)

        put("embed_tokens.weight", take("model.embed_tokens.weight"), matmul=True)
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"), matmul=True)
        weights.pop("lm_head.weight", None)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q = f"layers.{i}."
            attn = p + "self_attn."
            put(q + "self_attn.qkv_proj.weight", fused([attn + f"{n}_proj.weight" for n in "qkv"]), matmul=True)
            if cfg.attention_bias:
                put(q + "self_attn.qkv_proj.bias", torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"]))
            put(q + "self_attn.o_proj.weight", take(attn + "o_proj.weight"), matmul=True)
            if cfg.qk_norm:
                put(q + "self_attn.q_norm.weight", take(attn + "q_norm.weight"))
                put(q + "self_attn.k_norm.weight", take(attn + "k_norm.weight"))
            mlp = p + "mlp."
            put(q + "mlp.gate_up_proj.weight", fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"]), matmul=True)
            put(q + "mlp.down_proj.weight", take(mlp + "down_proj.weight"), matmul=True)
            norms = ["input_layernorm", "post_attention_layernorm"]
            if cfg.sandwich_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for norm in norms:
                put(q + norm + ".weight", take(p + norm + ".weight"))
