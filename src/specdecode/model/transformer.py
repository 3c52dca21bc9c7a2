"""A native Llama-family decoder (Llama, Qwen2): RMSNorm, RoPE, GQA, SwiGLU, optional qkv bias.

`Transformer.forward` maps tokens to logits and hidden states. It never samples, never
tokenizes and never changes its own config; all generation state lives in the `KVCache`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdecode.cache.kv_cache import KVCache
from specdecode.model.config import ModelConfig
from specdecode.model.linear import make_linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 like the reference implementations."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [D]
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # x: [..., D]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE (rotate-half convention) with cos/sin tables kept in fp32 whatever the model dtype."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1).float()  # [P, D]
        self.register_buffer("cos", angles.cos(), persistent=False)  # [P, D] fp32
        self.register_buffer("sin", angles.sin(), persistent=False)  # [P, D] fp32

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` ([B, T]) as [B, 1, T, D] in `dtype`."""
        return self.cos[positions][:, None].to(dtype), self.sin[positions][:, None].to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to x ([B, H, T, D]) with cos/sin ([B, 1, T, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query self-attention over the cache."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], prefix: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = make_linear(w[f"{prefix}q_proj.weight"], w.get(f"{prefix}q_proj.bias"))
        self.k_proj = make_linear(w[f"{prefix}k_proj.weight"], w.get(f"{prefix}k_proj.bias"))
        self.v_proj = make_linear(w[f"{prefix}v_proj.weight"], w.get(f"{prefix}v_proj.bias"))
        self.o_proj = make_linear(w[f"{prefix}o_proj.weight"])

    def forward(
        self,
        x: Tensor,  # [B, T, hidden]
        cos: Tensor,  # [B, 1, T, D]
        sin: Tensor,  # [B, 1, T, D]
        cache: KVCache,
        layer: int,
        mask: Tensor | None,  # [B, 1, T, S] bool or None
    ) -> Tensor:  # [B, T, hidden]
        batch, num_new, _ = x.shape
        q = self.q_proj(x).view(batch, num_new, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, num_new, self.num_kv_heads, self.head_dim)
        q = _rotate(q, cos, sin)  # [B, H, T, D]
        k = _rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, Hkv, D]
        keys, values = cache.update(layer, k, v)  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_new, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, w: dict[str, Tensor], prefix: str) -> None:
        super().__init__()
        self.gate_proj = make_linear(w[f"{prefix}gate_proj.weight"])
        self.up_proj = make_linear(w[f"{prefix}up_proj.weight"])
        self.down_proj = make_linear(w[f"{prefix}down_proj.weight"])

    def forward(self, x: Tensor) -> Tensor:  # [B, T, hidden] -> [B, T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], layer: int) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        self.layer = layer
        self.input_layernorm = RMSNorm(w[f"{p}input_layernorm.weight"], cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, w, f"{p}self_attn.")
        self.post_attention_layernorm = RMSNorm(
            w[f"{p}post_attention_layernorm.weight"], cfg.rms_norm_eps
        )
        self.mlp = MLP(w, f"{p}mlp.")

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, mask: Tensor | None
    ) -> Tensor:  # x: [B, T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, self.layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Llama-family decoder built from Hugging Face-named weights.

    Weights must already have the wanted dtype and device; the RoPE tables stay fp32.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor]) -> None:
        super().__init__()
        self.config = cfg
        embed = weights["model.embed_tokens.weight"]  # [V, hidden]
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(Block(cfg, weights, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps)
        head = embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = make_linear(head)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings).to(
            embed.device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache for `batch_size` rows of up to `capacity` tokens each."""
        cfg = self.config
        return KVCache(
            cfg.num_layers,
            batch_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            capacity,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [B, T] int64
        positions: Tensor,  # [B, T] int64
        cache: KVCache,
        mask: Tensor | None = None,  # [B, T, T] bool among the new tokens; None = causal
        exit_layer: int | None = None,  # run only the first `exit_layer` blocks
        logits_index: Tensor | None = None,  # [B, N] which of the T positions get logits
    ) -> tuple[Tensor, Tensor]:
        """Run the new tokens through the model, appending their keys/values to `cache`.

        Returns (logits [B, N, V] (N = T when logits_index is None), hidden [B, T, hidden]),
        where hidden is the final-normed output of the last block run.
        """
        num_layers = self.config.num_layers if exit_layer is None else exit_layer
        if not 0 < num_layers <= self.config.num_layers:
            raise ValueError(f"exit_layer must be in 1..{self.config.num_layers}, got {exit_layer}")
        attn_mask = cache.begin(tokens.shape[1], mask)
        cos, sin = self.rotary.tables(positions, self.dtype)
        x = self.embed_tokens(tokens)  # [B, T, hidden]
        for block in self.layers[:num_layers]:
            x = block(x, cos, sin, cache, attn_mask)
        cache.end()
        hidden = self.norm(x)
        if logits_index is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None]
            return self.lm_head(hidden[rows, logits_index]), hidden
        return self.lm_head(hidden), hidden
