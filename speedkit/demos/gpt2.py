"""GPT-2 as a user who never optimized would write it (the naive model of ANCHORS.md).

Learned position embedding, tied input/output embedding, pre-LayerNorm blocks with
``nn.LayerNorm``, one ``nn.Linear`` producing q, k, v, attention written by hand
(``q @ k.transpose``, scale, ``masked_fill`` with a causal mask buffer, ``softmax``, ``@ v``),
an MLP with tanh-GELU, and the loss ``F.cross_entropy(logits.float(), targets)``; plain AdamW, fp32.

``attention="sdpa"`` is the hand-rewritten variant the benchmarks' hand ladder uses.
"""

from __future__ import annotations

import math
from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {
    # name: (n_layer, n_head, n_embd, block_size, vocab_size)
    "tiny": (2, 2, 64, 64, 512),
    "mini": (4, 4, 128, 128, 2048),
    "small": (12, 12, 768, 1024, 50304),  # GPT-2 124M (vocab padded to a multiple of 64)
    "medium": (24, 16, 1024, 1024, 50304),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str) -> None:
        super().__init__()
        self.n_head, self.attention = n_head, attention
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer(
            "mask",
            torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)).view(1, 1, block_size, block_size),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, attention: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, attention)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NaiveGPT(pl.LightningModule):
    """The naive GPT-2 of ANCHORS.md as a LightningModule.

    Args:
        size: "tiny" (CPU tests), "mini", "small" (124M, the benchmark) or "medium".
        n_layer, n_head, n_embd, block_size, vocab_size: override the size's dimensions.
        attention: "naive" (hand-written, the default) or "sdpa" (rewritten by hand).
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        size: Literal["tiny", "mini", "small", "medium"] = "tiny",
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
        block_size: int | None = None,
        vocab_size: int | None = None,
        attention: Literal["naive", "sdpa"] = "naive",
        lr: float = 3e-4,
    ) -> None:
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, found {size!r}")
        if attention not in ("naive", "sdpa"):
            raise ValueError(f"attention must be 'naive' or 'sdpa', found {attention!r}")
        d = dict(zip(("n_layer", "n_head", "n_embd", "block_size", "vocab_size"), SIZES[size]))
        for k, v in (
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
            ("block_size", block_size),
            ("vocab_size", vocab_size),
        ):
            if v is not None:
                d[k] = v
        if d["n_embd"] % d["n_head"]:
            raise ValueError(f"n_embd ({d['n_embd']}) must be divisible by n_head ({d['n_head']})")
        self.save_hyperparameters()
        self.config = d
        self.lr = lr
        self.wte = nn.Embedding(d["vocab_size"], d["n_embd"])
        self.wpe = nn.Embedding(d["block_size"], d["n_embd"])
        self.h = nn.ModuleList(Block(d["n_embd"], d["n_head"], d["block_size"], attention) for _ in range(d["n_layer"]))
        self.ln_f = nn.LayerNorm(d["n_embd"])
        self.lm_head = nn.Linear(d["n_embd"], d["vocab_size"], bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        loss = self(idx, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
