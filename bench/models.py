"""Models from public libraries, wrapped the way people write them for Lightning.

``self.model = <the library's model>``, a ``training_step`` that calls ``self.model(...)`` and logs
its loss to the progress bar, ``configure_optimizers`` returning the optimizer people pick for the
family. Weights are random (built from configs; nothing is downloaded). Each class takes a ``size``:
the benchmark's full size, or ``"tiny"`` for a smoke test on a CPU.

* :class:`HFCausalLM` — Hugging Face ``GPT2LMHeadModel``, the loss through ``labels=``.
* :class:`TimmViT` — timm ``vit_base_patch16_224``.
* :class:`TorchvisionResNet` — torchvision ``resnet50``, SGD with momentum.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F


class HFCausalLM(pl.LightningModule):
    """Hugging Face GPT-2 (124M at ``size="small"``), trained on ``(input_ids, targets)`` batches."""

    def __init__(self, size: Literal["small", "tiny"] = "small", vocab_size: int = 50304, lr: float = 3e-4) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        layers, width, heads, positions = (12, 768, 12, 1024) if size == "small" else (2, 64, 2, 128)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=positions,
                                                vocab_size=vocab_size))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        input_ids, _ = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _ImageClassifier(pl.LightningModule):
    """``self.model(images)`` under cross-entropy: the training step of both vision models."""

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class TimmViT(_ImageClassifier):
    """timm's ViT-B/16 at 224 px (``size="tiny"``: ViT-Ti/16 at 32 px, for a CPU smoke test)."""

    def __init__(self, size: Literal["base", "tiny"] = "base", classes: int = 1000, lr: float = 1e-3) -> None:
        super().__init__()
        import timm

        if size == "base":
            self.model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=classes)
        else:
            self.model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=classes, img_size=32)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)


class TorchvisionResNet(_ImageClassifier):
    """torchvision's ResNet-50 (``size="tiny"``: ResNet-18, for a CPU smoke test)."""

    def __init__(self, size: Literal["50", "tiny"] = "50", classes: int = 1000, lr: float = 0.1) -> None:
        super().__init__()
        import torchvision

        self.model = (torchvision.models.resnet50 if size == "50" else torchvision.models.resnet18)(weights=None, num_classes=classes)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)
