"""The model zoo: models from public libraries, wrapped the way people write them for Lightning.

``self.model = <the library's model>``, a ``training_step`` that calls ``self.model(...)`` and logs
its loss to the progress bar, ``configure_optimizers`` returning the optimizer people pick for the
family. Weights are random (built from configs; nothing is downloaded), data is synthetic (drawn
from seeded generators) and comes through a DataLoader as people write it. Every model has a
``"full"`` size (the benchmark's) and a ``"tiny"`` one (CPU tests).

:data:`ZOO` maps each name to a :class:`ZooModel`: the library it comes from, a builder of
``(LightningModule, train DataLoader)``, the batch size per size and the throughput unit::

    module, loader = ZOO["hf-gpt2"].build("tiny")
    Trainer(callbacks=[SpeedLadder()]).fit(module, train_dataloaders=loader)

transformers, timm and torchvision are imported by the builders, so this module imports without them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from speedkit.demos.gpt2 import NaiveGPT

Size = Literal["full", "tiny"]

#: DataLoader workers of the full-size loaders (tiny loaders use none)
TOKEN_WORKERS, IMAGE_WORKERS = 2, 8
#: sequences or images per epoch, in batches
EPOCH_BATCHES = 4096


def _check_size(size: str) -> None:
    if size not in ("full", "tiny"):
        raise ValueError(f"size must be 'full' or 'tiny', found {size!r}")


# -- data -------------------------------------------------------------------------------------------


class _TokenSamples(Dataset):
    """Sample ``i``: ``(inputs (T,), targets (T,))`` int64, the targets shifted by one token, drawn
    from a generator seeded by ``i``."""

    def __init__(self, length: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.length, self.seq_len, self.vocab_size, self.seed = length, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        seq = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        return seq[:-1], seq[1:]


class _MaskedTokenSamples(Dataset):
    """Sample ``i``: BERT's masked-LM inputs as ``DataCollatorForLanguageModeling`` makes them, drawn
    from a generator seeded by ``i``: 15% of the positions are chosen, of those 80% become
    ``mask_id``, 10% a random token and 10% stay; ``labels`` hold the original ids there and -100
    elsewhere."""

    def __init__(self, length: int, seq_len: int, vocab_size: int, mask_id: int, seed: int) -> None:
        self.length, self.seq_len, self.vocab_size, self.mask_id, self.seed = length, seq_len, vocab_size, mask_id, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        T = self.seq_len
        ids = torch.randint(0, self.vocab_size, (T,), generator=g)
        chosen = torch.rand(T, generator=g) < 0.15
        how = torch.rand(T, generator=g)
        inputs = torch.where(chosen & (how < 0.8), self.mask_id, ids)
        inputs = torch.where(chosen & (how >= 0.8) & (how < 0.9), torch.randint(0, self.vocab_size, (T,), generator=g), inputs)
        return {"input_ids": inputs, "attention_mask": torch.ones(T, dtype=torch.long),
                "labels": torch.where(chosen, ids, -100)}


class _ImageSamples(Dataset):
    """Sample ``i``: ``(image (3, S, S) uint8, label)``: one of ``bank`` random images drawn once from
    a seeded generator, as a decoded dataset held in memory gives them (bytes, normalised on the
    GPU by the model's ``on_after_batch_transfer``; fp32 images would move 4x the bytes through the
    workers and bound a GPU's step by the loader), its label drawn per sample."""

    def __init__(self, length: int, size: int, classes: int, seed: int, bank: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (bank, 3, size, size), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, classes, (length,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index % len(self.images)], int(self.labels[index])


def _loader(dataset: Dataset, batch_size: int, workers: int) -> DataLoader:
    """Shuffled, whole batches, ``workers`` persistent worker processes and pinned memory when any."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                      pin_memory=workers > 0, persistent_workers=workers > 0)


def token_loader(batch_size: int, seq_len: int, vocab_size: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``(inputs (B, T), targets (B, T))`` random token ids."""
    return _loader(_TokenSamples(batch_size * EPOCH_BATCHES, seq_len, vocab_size, seed), batch_size, workers)


def mlm_loader(batch_size: int, seq_len: int, vocab_size: int, mask_id: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``{"input_ids", "attention_mask", "labels"}`` (B, T) for masked-LM training."""
    return _loader(_MaskedTokenSamples(batch_size * EPOCH_BATCHES, seq_len, vocab_size, mask_id, seed), batch_size, workers)


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_loader(batch_size: int, size: int, classes: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``(images (B, 3, S, S) uint8, labels (B,))``."""
    return _loader(_ImageSamples(batch_size * EPOCH_BATCHES, size, classes, seed), batch_size, workers)


# -- language models --------------------------------------------------------------------------------


class _HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM on ``(input_ids, targets)`` batches, the loss through ``labels=``
    (the model shifts them itself); AdamW as for GPT-style pre-training."""

    model: Any

    def __init__(self, vocab_size: int, lr: float) -> None:
        super().__init__()
        self.vocab_size, self.lr = vocab_size, lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, _ = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)


class HFGPT2(_HFCausalLM):
    """transformers' ``GPT2LMHeadModel``: GPT-2 small (124M) at ``size="full"``; 2 layers of width 64
    at ``"tiny"``. ``attn_implementation``: the library's switch (None: its default)."""

    def __init__(self, size: Size = "full", vocab_size: int | None = None, attn_implementation: str | None = None,
                 lr: float = 3e-4) -> None:
        _check_size(size)
        super().__init__(vocab_size or (50257 if size == "full" else 512), lr)
        from transformers import GPT2Config, GPT2LMHeadModel

        dims = (dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024) if size == "full"
                else dict(n_layer=2, n_embd=64, n_head=2, n_positions=64))
        last = self.vocab_size - 1  # GPT-2's <|endoftext|>, inside a smaller vocabulary too
        self.model = GPT2LMHeadModel(GPT2Config(**dims, vocab_size=self.vocab_size, bos_token_id=last, eos_token_id=last,
                                                attn_implementation=attn_implementation))


class HFLlama(_HFCausalLM):
    """transformers' ``LlamaForCausalLM``: 400M parameters at ``size="full"`` (12 layers of width 1536,
    12 heads over 4 key-value heads, SwiGLU 4096, vocabulary 32000); 2 layers of width 64 at ``"tiny"``."""

    def __init__(self, size: Size = "full", vocab_size: int | None = None, attn_implementation: str | None = None,
                 lr: float = 3e-4) -> None:
        _check_size(size)
        super().__init__(vocab_size or (32000 if size == "full" else 512), lr)
        from transformers import LlamaConfig, LlamaForCausalLM

        dims = (dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=4, max_position_embeddings=2048) if size == "full"
                else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64))
        self.model = LlamaForCausalLM(LlamaConfig(**dims, vocab_size=self.vocab_size, attn_implementation=attn_implementation))


class HFBertMLM(pl.LightningModule):
    """transformers' ``BertForMaskedLM`` on masked-LM batches (``self.model(**batch)``): BERT-base
    (110M) at ``size="full"``, 2 layers of width 64 at ``"tiny"``; AdamW as in BERT's recipe."""

    #: BERT's [MASK] token id
    MASK_ID = 103

    def __init__(self, size: Size = "full", vocab_size: int | None = None, attn_implementation: str | None = None,
                 lr: float = 1e-4) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        _check_size(size)
        dims = (dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                     max_position_embeddings=512) if size == "full"
                else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                          max_position_embeddings=64))
        self.vocab_size, self.lr = vocab_size or (30522 if size == "full" else 512), lr
        self.model = BertForMaskedLM(BertConfig(**dims, vocab_size=self.vocab_size, attn_implementation=attn_implementation))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class LightningDemoTransformer(pl.LightningModule):
    """``lightning.pytorch.demos.Transformer`` trained as the demo's ``LightningTransformer`` does:
    ``forward`` calls the model, the step takes ``nll_loss`` of its log-probabilities, plain SGD. At
    ``size="full"`` the demo's own dimensions (WikiText-2's vocabulary, width 200, 2+2 layers; 15M
    parameters), at ``"tiny"`` width 32 and 1+1 layers."""

    def __init__(self, size: Size = "full", vocab_size: int | None = None, lr: float = 0.1) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        _check_size(size)
        dims = dict(ninp=200, nhead=2, nhid=200, nlayers=2) if size == "full" else dict(ninp=32, nhead=2, nhid=64, nlayers=1)
        self.vocab_size, self.lr = vocab_size or (33278 if size == "full" else 512), lr
        self.model = Transformer(vocab_size=self.vocab_size, **dims)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self(inputs, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


# -- vision models ----------------------------------------------------------------------------------


class _ImageClassifier(pl.LightningModule):
    """``self.model(images)`` under cross-entropy: the training step of every vision model."""

    model: Any

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 images to normalised floats on the device (Lightning's hook for GPU preprocessing)."""
        images, labels = batch
        if images.dtype != torch.uint8:  # already floats (another loader): as they come
            return batch
        mean = images.new_tensor(IMAGENET_MEAN, dtype=torch.float32).view(1, 3, 1, 1)
        std = images.new_tensor(IMAGENET_STD, dtype=torch.float32).view(1, 3, 1, 1)
        return (images.float().div_(255) - mean) / std, labels

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class _TimmClassifier(_ImageClassifier):
    """A timm model built by name (``arch``), with ``tiny`` overriding its dimensions at
    ``size="tiny"``; AdamW with weight decay 0.05, as in the recipes of both timm models here."""

    arch: ClassVar[str]
    tiny: ClassVar[dict[str, Any]]

    def __init__(self, size: Size, classes: int, lr: float) -> None:
        super().__init__()
        import timm

        _check_size(size)
        dims = {} if size == "full" else self.tiny
        self.model = timm.create_model(self.arch, pretrained=False, num_classes=classes, **dims)
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.05)


class TimmViT(_TimmClassifier):
    """timm's ``vit_base_patch16_224`` (ViT-B/16 at 224 px); at ``size="tiny"`` the same model class
    with 2 blocks of width 64, 8-px patches of 32-px images; AdamW as in DeiT."""

    arch = "vit_base_patch16_224"
    tiny = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)

    def __init__(self, size: Size = "full", classes: int = 1000, lr: float = 1e-3) -> None:
        super().__init__(size, classes, lr)


class TimmConvNeXt(_TimmClassifier):
    """timm's ``convnext_tiny`` at 224 px; at ``size="tiny"`` one block per stage, widths 16 to 64;
    AdamW as in ConvNeXt's recipe."""

    arch = "convnext_tiny"
    tiny = dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64))

    def __init__(self, size: Size = "full", classes: int = 1000, lr: float = 4e-3) -> None:
        super().__init__(size, classes, lr)


class TorchvisionResNet50(_ImageClassifier):
    """torchvision's ``resnet50``; at ``size="tiny"`` its bottleneck blocks, one per stage; SGD with
    momentum as in torchvision's recipe."""

    def __init__(self, size: Size = "full", classes: int = 1000, lr: float = 0.1) -> None:
        super().__init__()
        import torchvision
        from torchvision.models.resnet import Bottleneck, ResNet

        _check_size(size)
        self.model = (torchvision.models.resnet50(weights=None, num_classes=classes) if size == "full"
                      else ResNet(Bottleneck, [1, 1, 1, 1], num_classes=classes))
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


# -- the registry -----------------------------------------------------------------------------------

Builder = Callable[..., tuple[pl.LightningModule, DataLoader]]


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo.

    Attributes:
        name: the zoo's name for it.
        library: the package it comes from, as imported ("transformers", "timm", ...).
        unit: what its throughput counts: "tokens" or "samples".
        batch_size: per size.
        make: ``make(size, batch_size, seed, **options) -> (module, loader)``; options go to the module.
        switches: the library's own speed switches, as module options (HF: ``attn_implementation="sdpa"``).
    """

    name: str
    library: str
    unit: Literal["tokens", "samples"]
    batch_size: Mapping[Size, int]
    make: Builder
    switches: Mapping[str, Any] = field(default_factory=dict)

    def build(self, size: Size = "full", *, batch_size: int | None = None, seed: int = 0,
              **options: Any) -> tuple[pl.LightningModule, DataLoader]:
        """The LightningModule (weights drawn after ``torch.manual_seed(seed)``) and its train loader."""
        _check_size(size)
        torch.manual_seed(seed)
        return self.make(size, batch_size or self.batch_size[size], seed, **options)


#: tokens per sequence, per size
SEQ_LEN: dict[Size, int] = {"full": 1024, "tiny": 32}


def _causal_lm(cls: type[pl.LightningModule], seq_len: Mapping[Size, int] = SEQ_LEN) -> Builder:
    def make(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
        module = cls(size, **options)
        workers = TOKEN_WORKERS if size == "full" else 0
        return module, token_loader(batch_size, seq_len[size], module.vocab_size, workers, seed)

    return make


def _nanogpt(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    module = NaiveGPT("small" if size == "full" else "tiny", **options)
    workers = TOKEN_WORKERS if size == "full" else 0
    return module, token_loader(batch_size, SEQ_LEN[size], module.config["vocab_size"], workers, seed)


def _bert(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    module = HFBertMLM(size, **options)
    workers = TOKEN_WORKERS if size == "full" else 0
    return module, mlm_loader(batch_size, {"full": 512, "tiny": 32}[size], module.vocab_size, HFBertMLM.MASK_ID, workers, seed)


def _vision(cls: type[pl.LightningModule]) -> Builder:
    def make(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
        classes = options.pop("classes", 1000 if size == "full" else 10)
        module = cls(size, classes=classes, **options)
        workers = IMAGE_WORKERS if size == "full" else 0
        return module, image_loader(batch_size, 224 if size == "full" else 32, classes, workers, seed)

    return make


_HF_SDPA = {"attn_implementation": "sdpa"}

ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("hf-gpt2", "transformers", "tokens", {"full": 16, "tiny": 4}, _causal_lm(HFGPT2), _HF_SDPA),
    ZooModel("hf-llama", "transformers", "tokens", {"full": 8, "tiny": 4}, _causal_lm(HFLlama), _HF_SDPA),
    ZooModel("hf-bert-mlm", "transformers", "tokens", {"full": 16, "tiny": 4}, _bert, _HF_SDPA),
    ZooModel("timm-vit", "timm", "samples", {"full": 64, "tiny": 4}, _vision(TimmViT)),
    ZooModel("timm-convnext", "timm", "samples", {"full": 64, "tiny": 4}, _vision(TimmConvNeXt)),
    ZooModel("tv-resnet50", "torchvision", "samples", {"full": 64, "tiny": 4}, _vision(TorchvisionResNet50)),
    # the demo's own sequence length (WikiText2's block_size=35); its batch of one is no benchmark
    ZooModel("lightning-transformer", "lightning", "tokens", {"full": 64, "tiny": 4},
             _causal_lm(LightningDemoTransformer, {"full": 35, "tiny": 32})),
    ZooModel("nanogpt", "speedkit", "tokens", {"full": 16, "tiny": 4}, _nanogpt),
)}

