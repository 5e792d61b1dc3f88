"""Hand-written attention in the forms people write, for the sdpa rung's tests.

Each class is a small nn.Module computing attention by hand; the sdpa rung must rewrite the
positive ones to SDPA with the same outputs and gradients, and leave the negative ones alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# -- positive forms -------------------------------------------------------------------------------


class KarpathyHead(nn.Module):
    """One head (3-D tensors), causal `tril` buffer compared to 0, `**-0.5` scale, nn.Dropout."""

    def __init__(self, d: int = 24, hs: int = 8, block: int = 64) -> None:
        super().__init__()
        self.key = nn.Linear(d, hs, bias=False)
        self.query = nn.Linear(d, hs, bias=False)
        self.value = nn.Linear(d, hs, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block, block)))
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        B, T, C = x.shape
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-1)
        wei = self.dropout(wei)
        v = self.value(x)
        out = wei @ v
        return out


class PerHeadModules(nn.Module):
    """Multi-head attention as a ModuleList of single heads, concatenated."""

    def __init__(self, d: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.heads = nn.ModuleList([KarpathyHead(d, d // heads) for _ in range(heads)])
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class PerHeadLoop(nn.Module):
    """A Python loop over heads inside one module, torch.matmul, divide by sqrt, bool mask argument."""

    def __init__(self, d: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.n_head = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, pad_mask=None):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, hs).unbind(2)
        outs = []
        for h in range(self.n_head):
            qh, kh, vh = q[:, :, h], k[:, :, h], v[:, :, h]
            att = torch.matmul(qh, kh.transpose(-1, -2)) / math.sqrt(hs)
            if pad_mask is not None:
                att = att.masked_fill(pad_mask, float("-inf"))
            att = torch.softmax(att, -1)
            outs.append(att @ vh)
        return torch.cat(outs, dim=-1)


class HFStyleAttention(nn.Module):
    """Hugging Face eager style: matmul + transpose(2, 3), `* scaling`, additive mask sliced under an
    `if`, softmax in fp32 cast back, functional dropout, weights returned only if asked for."""

    def __init__(self, hidden: int = 24, heads: int = 3, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = attention_dropout
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask

        # upcast attention to fp32
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        if not output_attentions:
            attn_weights = None
        return attn_output, attn_weights


class EinsumAttention(nn.Module):
    """einsum for both products, additive float mask, method softmax."""

    def __init__(self, d: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, bias):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(C // self.h)
        scores = scores + bias
        p = scores.softmax(dim=-1)
        out = torch.einsum("bhij,bhjd->bhid", p, v)
        return out.transpose(1, 2).reshape(B, T, C)


class ScaledQueryCausalAndPadding(nn.Module):
    """Scale applied to q before the matmul, `.mT`, causal buffer AND a padding mask, fp32 softmax."""

    def __init__(self, d: int = 24, heads: int = 3, block: int = 64) -> None:
        super().__init__()
        self.h = heads
        self.scale = (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("causal", torch.triu(torch.ones(block, block, dtype=torch.bool), diagonal=1))

    def forward(self, x, pad):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        att = (q * self.scale) @ k.mT
        att = att.masked_fill(self.causal[:T, :T], float("-inf"))
        att = att.masked_fill(pad[:, None, None, :], float("-inf"))
        att = F.softmax(att.float(), dim=-1).type_as(q)
        y = att @ v
        return y.transpose(1, 2).reshape(B, T, C)


class StoresWeightsNoDropout(nn.Module):
    """Keeps the attention weights for inspection; without dropout they stay exact (computed on demand)."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.last_attention = None

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1)
        y = att @ v
        self.last_attention = att.detach()
        return y


class OneExpression(nn.Module):
    """Scores, scale, causal buffer, softmax and @ v in one expression."""

    def __init__(self, d: int = 24, block: int = 64) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.register_buffer("mask", torch.tril(torch.ones(1, 1, block, block, dtype=torch.bool)))

    def forward(self, x):
        T = x.size(1)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return ((q @ k.transpose(-2, -1) / 5.0).masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(-1) @ v).squeeze(1)


# -- negative forms: must be left alone ---------------------------------------------------------


class StoresWeightsWithDropout(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        att = self.drop(att)
        y = att @ v
        return y, att


class SoftmaxOverOtherDim(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = F.softmax(q @ k.transpose(-2, -1), dim=1)
        return att @ v


class FillsWithLargeNegative(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1)
        att = att.masked_fill(mask, -1e9)
        att = att.softmax(-1)
        return att @ v


class ScoresReadMidway(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1)
        self.raw_scores = att.detach()
        att = att.softmax(-1)
        return att @ v


class HeadMaskAfterSoftmax(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, head_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)).softmax(-1)
        att = att * head_mask
        return att @ v


class ScaleAfterAdditiveMask(nn.Module):
    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, bias):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = q @ k.transpose(-2, -1)
        att = att + bias
        att = att / math.sqrt(q.size(-1))
        att = att.softmax(-1)
        return att @ v
