"""A trainable EAGLE-3 head with training-time test (TTT) unrolling.

The same layer as `specdecode.heads.eagle3.Eagle3Head`, in plain torch ops with fp32 master
weights, run over whole sequences. Step 0 reads the target's fused states: column t reads
(token t + 1, state t) at position t and predicts token t + 2. Step j > 0 reads the step
before's pre-norm output of the same column with token t + j + 1 at position t + j, and attends
to step 0's entries 0..t and to its own column's entries of steps 1..j (EAGLE-3's TTT mask):
exactly what the drafter's cache holds when it drafts its (j + 1)-th token after committed
entry t. So step j's loss trains the head on its own drafted features, as at inference.

A parallel head (`parallel_tokens` > 0) drafts all its tokens in one pass: its step j > 0
entries read the learned mask embedding and mask feature (`mask_embed`, `mask_hidden`) in
place of token t + j + 1 and step j - 1's output, with the same positions and the same mask,
which is what the drafter's one pass holds: the newest entry, then its mask entries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.heads.eagle3 import LAYER, head_tensor_shapes, save_eagle3_head
from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.train.head_params import HeadParameters, param_key, rms_norm


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half) of x ([B, H, T, D]) with cos/sin ([T, D])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class TrainableEagle3(HeadParameters):
    """EAGLE-3 head parameters (speculators' names) and the TTT forward.

    Args:
        cfg: the head's shape.
        weights: initial tensors (`head_tensor_shapes` names; "d2t" int64), copied as fp32.
        embed: the target's token embedding ([V, h]; frozen, not saved).
    """

    def __init__(self, cfg: Eagle3HeadConfig, weights: Mapping[str, Tensor], embed: Tensor):
        super().__init__(head_tensor_shapes(cfg), weights)
        self.config = cfg
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.shift = 1  # step j of column t predicts token t + j + 2
        lay = cfg.layer
        inv = 1.0 / lay.rope_theta ** (
            torch.arange(0, lay.head_dim, 2, dtype=torch.float64) / lay.head_dim
        )
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the head fuses."""
        return self.config.aux_layers

    def save(self, path: Path, weights: Mapping[str, Tensor], extra: dict[str, object]) -> None:
        """Write the head folder with `weights` (`head_weights()`, cast) and `extra`."""
        save_eagle3_head(path, self.config, weights, extra)

    def _linear(self, x: Tensor, weight: str) -> Tensor:
        """x @ W^T (+ the bias where the head has one), W named `weight`."""
        bias = param_key(weight.removesuffix("weight") + "bias")
        return F.linear(x, self.p(weight), self.params.get(bias, None))

    def forward(self, features: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        """Pre-norm outputs of `steps` unrolled steps over a batch of sequences (`logits`
        turns the rows that matter into logits: the output head is the largest matmul).

        features: [B, T, F] the target's concatenated states (F = len(aux layers) * h).
        tokens: [B, T] the sequences' token ids (target ids).
        Returns per step j: [B, T, h]; column t predicts token t + j + 2.
        """
        lay = self.config.layer
        batch, length, _ = features.shape
        heads, kv_heads, dim = lay.num_heads, lay.num_kv_heads, lay.head_dim
        group = heads // kv_heads
        eps = lay.rms_norm_eps
        hidden = self._linear(features.to(self.p("fc.weight").dtype), "fc.weight")  # [B,T,h]
        keys: list[Tensor] = []
        values: list[Tensor] = []
        outputs = []
        for step in range(steps):
            if step and self.config.parallel_tokens:  # mask entries
                token_embeds = self.p("mask_embed").expand(batch, length, -1)
                hidden = self.p("mask_hidden").expand(batch, length, -1).to(hidden.dtype)
            else:
                shifted = torch.zeros_like(tokens)
                shifted[:, : length - step - 1] = tokens[:, step + 1 :]  # column t: t+step+1
                token_embeds = self.embed[shifted]
            embeds = rms_norm(token_embeds, self.p(f"{LAYER}input_layernorm.weight"), eps)
            normed = rms_norm(hidden, self.p(f"{LAYER}hidden_norm.weight"), eps)
            residual = normed if self.config.norm_before_residual else hidden
            x = torch.cat([embeds.to(normed.dtype), normed], dim=-1)  # [B, T, 2h]
            q = self._linear(x, f"{LAYER}self_attn.q_proj.weight")
            k = self._linear(x, f"{LAYER}self_attn.k_proj.weight")
            v = self._linear(x, f"{LAYER}self_attn.v_proj.weight")
            q = q.view(batch, length, heads, dim).transpose(1, 2)  # [B, H, T, D]
            k = k.view(batch, length, kv_heads, dim).transpose(1, 2)  # [B, Hkv, T, D]
            v = v.view(batch, length, kv_heads, dim).transpose(1, 2)
            positions = torch.arange(length, device=x.device, dtype=torch.float32) + step
            angles = torch.outer(positions, self.inv_freq)
            angles = torch.cat([angles, angles], dim=-1)  # [T, D]
            cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys.append(k.repeat_interleave(group, dim=1))  # [B, H, T, D]
            values.append(v.repeat_interleave(group, dim=1))
            attn = self._ttt_attention(q, keys, values)  # [B, H, T, D]
            attn = attn.transpose(1, 2).reshape(batch, length, heads * dim)
            x = residual + self._linear(attn, f"{LAYER}self_attn.o_proj.weight")
            y = rms_norm(x, self.p(f"{LAYER}post_attention_layernorm.weight"), eps)
            gate = self._linear(y, f"{LAYER}mlp.gate_proj.weight")
            up = self._linear(y, f"{LAYER}mlp.up_proj.weight")
            x = x + self._linear(F.silu(gate) * up, f"{LAYER}mlp.down_proj.weight")
            hidden = x  # [B, T, h] pre-norm: the next step's feature
            outputs.append(x)
        return outputs

    def logits(self, hidden: Tensor) -> Tensor:
        """The output head over pre-norm outputs: [..., h] -> [..., Vd] logits."""
        normed = rms_norm(hidden, self.p("norm.weight"), self.config.layer.rms_norm_eps)
        return self._linear(normed, "lm_head.weight")

    @staticmethod
    def _ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """Step len(keys) - 1's attention: causal over step 0, plus its own column's entries of
        steps 1..j. q: [B, H, T, D]; keys, values: per step [B, H, T, D]."""
        if len(keys) == 1:
            return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = (q @ keys[0].transpose(-1, -2)).float() * scale  # [B, H, T, T]
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = torch.stack([(q * k).sum(-1).float() * scale for k in keys[1:]], -1)  # [B,H,T,j]
        probs = torch.cat([scores, diag], dim=-1).softmax(-1).to(q.dtype)
        out = probs[..., :length] @ values[0]
        for s, v in enumerate(values[1:]):
            out = out + probs[..., length + s, None] * v
        return out
