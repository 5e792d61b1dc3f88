"""Many small GEMMs written one at a time (naively, on purpose): what the ``batched`` rung rewrites.

* :class:`LoopOfGEMMs` — a Python loop of 40 per-slice 256×256 matmuls, stacked after; one
  ``torch.bmm`` computes the same (the loop launches 40 GEMMs that each fill a sliver of a GPU).
* :class:`LoopGEMMModel` + :class:`SyntheticGEMMs` — the loop inside a LightningModule, with data.
* :class:`SiblingProjections` — separate q/k/v and gate/up ``nn.Linear`` layers on one input.
* :class:`HeadsList` — per-head Linears in an ``nn.ModuleList``, concatenated.
* :class:`Ensemble` — identical small MLPs applied to one input, averaged.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class LoopOfGEMMs(nn.Module):
    """``y[i] = x[i] @ weight[i]`` for each of ``n`` slices, one matmul at a time.

    Args:
        n: slices (matmuls per forward).
        dim: each slice is (dim, dim).
    """

    def __init__(self, n: int = 40, dim: int = 256) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.randn(n, dim, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n, dim, dim)
        outs = []
        for i in range(self.n):
            outs.append(x[i] @ self.weight[i])  # (dim, dim)
        return torch.stack(outs)  # (n, dim, dim)


class LoopGEMMModel(pl.LightningModule):
    """:class:`LoopOfGEMMs` regressed onto a target with MSE, AdamW. Small by default.

    Args: n, dim (of :class:`LoopOfGEMMs`), lr.
    """

    def __init__(self, n: int = 16, dim: int = 64, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.gemms = LoopOfGEMMs(n, dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        y = self.gemms(x)
        return y if target is None else F.mse_loss(y, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        loss = self(x, target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _GEMMBatches(Dataset):
    """Item ``i`` is batch ``i``: ``(x (n, dim, dim), target (n, dim, dim))``, float32."""

    def __init__(self, batches: int, n: int, dim: int, seed: int) -> None:
        self.batches, self.n, self.dim, self.seed = batches, n, dim, seed

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.n, self.dim, self.dim, generator=g), torch.randn(self.n, self.dim, self.dim, generator=g)


class SyntheticGEMMs(pl.LightningDataModule):
    """Random slices for :class:`LoopGEMMModel`: batches of ``(x, target)``, each (n, dim, dim).

    Args:
        n: slices per batch (must match the model's ``n``).
        dim: slice size.
        batches: batches per epoch.
        seed: base seed of the per-index generators.
    """

    def __init__(self, n: int = 16, dim: int = 64, batches: int = 64, seed: int = 0) -> None:
        super().__init__()
        for name, value in (("n", n), ("dim", dim), ("batches", batches)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        self.n, self.dim, self.batches, self.seed = n, dim, batches, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_GEMMBatches(self.batches, self.n, self.dim, self.seed), batch_size=None, shuffle=False)


class SiblingProjections(nn.Module):
    """A transformer block's projections written separately: q/k/v, and a gated MLP's gate/up.

    Args: dim (model width), n_head, hidden (MLP width).
    """

    def __init__(self, dim: int = 64, n_head: int = 4, hidden: int = 128) -> None:
        super().__init__()
        self.n_head = n_head
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, dim)
        B, T, C = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        h = self.norm(x)
        gate = self.gate_proj(h)
        up = self.up_proj(h)
        return x + self.down_proj(F.silu(gate) * up)


class HeadsList(nn.Module):
    """``n_heads`` separate Linear heads in a ModuleList, concatenated.

    Args: dim (input width), head_dim (each head's output width), n_heads.
    """

    def __init__(self, dim: int = 64, head_dim: int = 16, n_heads: int = 4) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(dim, head_dim) for _ in range(n_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., dim)
        return torch.cat([h(x) for h in self.heads], dim=-1)  # (..., n_heads * head_dim)


class Ensemble(nn.Module):
    """``members`` identical two-layer MLPs applied to the same input, averaged.

    Args: dim (input width), hidden, out, members.
    """

    def __init__(self, dim: int = 64, hidden: int = 128, out: int = 10, members: int = 4) -> None:
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, out)) for _ in range(members)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, dim)
        return torch.stack([m(x) for m in self.members]).mean(0)  # (B, out)
