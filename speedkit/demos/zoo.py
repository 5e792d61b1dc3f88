"""The model zoo: models from public libraries, wrapped the way people write them for Lightning.

``self.model = <the library's model>``, a ``training_step`` that calls ``self.model(...)`` and logs
its loss to the progress bar, ``configure_optimizers`` returning the optimizer people pick for the
family and, where the family's own training examples schedule the learning rate, their scheduler in
Lightning's dict form (``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": ...}}``).
Weights are random (built from configs; nothing is downloaded), data is synthetic (drawn from seeded
generators) and comes through a DataLoader as people write it, with the library's own collator
where its examples use one. Every model has a ``"full"`` size (the benchmark's) and a ``"tiny"`` one
(CPU tests).

:data:`ZOO` maps each name to a :class:`ZooModel`: the library it comes from, a builder of
``(LightningModule, train DataLoader)``, the batch size per size and the throughput unit::

    module, loader = ZOO["hf-gpt2"].build("tiny")
    Trainer(callbacks=[SpeedLadder()]).fit(module, train_dataloaders=loader)

transformers, timm and torchvision are imported by the builders, so this module imports without them.

Why one module of about 1,150 lines: it is a catalogue, one short entry per model family (its module,
its data, its builder) read side by side when comparing how each is trained; the entries share the
loaders and size tables at the top and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from speedkit.demos.gpt2 import NaiveGPT

Size = Literal["full", "tiny"]

#: DataLoader workers of the full-size loaders (tiny loaders use none, but tv-resnet18-randaug's: its 2 are its point)
TOKEN_WORKERS, IMAGE_WORKERS = 2, 8
#: sequences or images per epoch, in batches
EPOCH_BATCHES = 4096


def _check_size(size: str) -> None:
    if size not in ("full", "tiny"):
        raise ValueError(f"size must be 'full' or 'tiny', found {size!r}")


def _library(name: str, model: str) -> Any:
    """The zoo library ``name`` that ``model`` is built with, or one ConfigError naming how to install it
    (the demo's install has torch alone; the shipped tv-resnet50-ddp recipe met "No module named
    'torchvision'" there)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        from speedkit.errors import ConfigError

        raise ConfigError(
            "model",
            f"{model} is built with {name}, which is not installed here: install the zoo's libraries with "
            "`make test` (or `pip install -e '.[test]'`; torchvision must match the installed torch's version)",
        ) from None


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
        return {"input_ids": inputs, "attention_mask": torch.ones(T, dtype=torch.long), "labels": torch.where(chosen, ids, -100)}


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


class _Seq2SeqSamples(Dataset):
    """Sample ``i``: a source and a target text as Hugging Face's summarization and translation examples
    feed an encoder-decoder with ``--pad_to_max_length`` (then their collator is
    ``default_data_collator``, which stacks, as the DataLoader's default collation does): ``input_ids``
    and ``attention_mask`` (S,) padded to S, ``labels`` (L,) padded to L with -100 (their
    ``--ignore_pad_token_for_loss``), each text ending in EOS; true lengths S/2..S and L/4..L, all drawn
    from a generator seeded by ``i``. ``input_ids`` comes first: a dict batch's first tensor is what
    :func:`speedkit.data.count_items` counts (the B x S source tokens)."""

    PAD, EOS = 0, 1  # T5's

    def __init__(self, length: int, source_len: int, target_len: int, vocab_size: int, seed: int) -> None:
        self.length, self.source_len, self.target_len = length, source_len, target_len
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        S, L = self.source_len, self.target_len
        n, m = int(torch.randint(S // 2, S + 1, (), generator=g)), int(torch.randint(max(1, L // 4), L + 1, (), generator=g))
        source = torch.full((S,), self.PAD)
        source[:n] = torch.randint(2, self.vocab_size, (n,), generator=g)
        labels = torch.full((L,), -100)
        labels[:m] = torch.randint(2, self.vocab_size, (m,), generator=g)
        source[n - 1], labels[m - 1] = self.EOS, self.EOS
        return {"input_ids": source, "attention_mask": (torch.arange(S) < n).long(), "labels": labels}


class _TextClassificationSamples(Dataset):
    """Sample ``i``: one text of a classification dataset as Hugging Face's text-classification example
    tokenizes it (``tokenizer(text, truncation=True)``, unpadded) and labels it: ``input_ids``
    (``[CLS] ... [SEP]``), ``token_type_ids`` and ``attention_mask`` as Python lists of the text's own
    length, drawn from ``min_len..max_len``, and ``labels``, an int; drawn from a generator seeded by
    ``i``. The loader's collator pads each batch to its longest text."""

    CLS, SEP = 101, 102  # BERT's

    def __init__(self, length: int, min_len: int, max_len: int, vocab_size: int, classes: int, seed: int) -> None:
        self.length, self.min_len, self.max_len, self.vocab_size, self.classes, self.seed = (
            length,
            min_len,
            max_len,
            vocab_size,
            classes,
            seed,
        )

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n = int(torch.randint(self.min_len, self.max_len + 1, (), generator=g))
        words = torch.randint(self.SEP + 2, self.vocab_size, (n - 2,), generator=g).tolist()  # past [MASK]
        return {
            "input_ids": [self.CLS, *words, self.SEP],
            "token_type_ids": [0] * n,
            "attention_mask": [1] * n,
            "labels": int(torch.randint(0, self.classes, (), generator=g)),
        }


def _loader(dataset: Dataset, batch_size: int, workers: int, collate_fn: Callable[[list[Any]], Any] | None = None) -> DataLoader:
    """Shuffled, whole batches, ``workers`` persistent worker processes and pinned memory when any;
    ``collate_fn`` None: the DataLoader's default collation."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=workers > 0,
        persistent_workers=workers > 0,
        collate_fn=collate_fn,
    )


def token_loader(batch_size: int, seq_len: int, vocab_size: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``(inputs (B, T), targets (B, T))`` random token ids."""
    return _loader(_TokenSamples(batch_size * EPOCH_BATCHES, seq_len, vocab_size, seed), batch_size, workers)


def mlm_loader(batch_size: int, seq_len: int, vocab_size: int, mask_id: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``{"input_ids", "attention_mask", "labels"}`` (B, T) for masked-LM training."""
    return _loader(_MaskedTokenSamples(batch_size * EPOCH_BATCHES, seq_len, vocab_size, mask_id, seed), batch_size, workers)


def seq2seq_loader(
    batch_size: int, source_len: int, target_len: int, vocab_size: int, workers: int = 0, seed: int = 0
) -> DataLoader:
    """Batches of ``{"input_ids", "attention_mask"}`` (B, S) and ``{"labels"}`` (B, L) for encoder-decoder training."""
    return _loader(_Seq2SeqSamples(batch_size * EPOCH_BATCHES, source_len, target_len, vocab_size, seed), batch_size, workers)


def padding_tokenizer() -> Any:
    """A fast tokenizer that knows only BERT's special tokens, ``[PAD]`` (id 0) among them: all
    ``DataCollatorWithPadding`` asks of its tokenizer is to pad (its pad id, padding side and input
    names). The zoo's texts come tokenized; a real vocabulary would be a download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    special = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(special, unk_token="[UNK]")),
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def text_classification_loader(
    batch_size: int, min_len: int, max_len: int, vocab_size: int, classes: int, workers: int = 0, seed: int = 0
) -> DataLoader:
    """Batches of tokenized texts of ``min_len..max_len`` tokens, padded to the batch's longest by
    transformers' ``DataCollatorWithPadding`` (as the library's text-classification example batches
    them): a ``BatchEncoding`` of ``input_ids``, ``token_type_ids``, ``attention_mask`` (B, longest)
    and ``labels`` (B,)."""
    from transformers import DataCollatorWithPadding

    return _loader(
        _TextClassificationSamples(batch_size * EPOCH_BATCHES, min_len, max_len, vocab_size, classes, seed),
        batch_size,
        workers,
        DataCollatorWithPadding(padding_tokenizer()),
    )


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_loader(batch_size: int, size: int, classes: int, workers: int = 0, seed: int = 0) -> DataLoader:
    """Batches of ``(images (B, 3, S, S) uint8, labels (B,))``."""
    return _loader(_ImageSamples(batch_size * EPOCH_BATCHES, size, classes, seed), batch_size, workers)


class _AugmentedJpegSamples(Dataset):
    """Sample ``i``: an image decoded and augmented on the CPU, as torchvision's ImageNet recipe trains
    a classifier: ``decode_jpeg``, ``RandomResizedCrop`` to ``crop`` px (scale 0.08-1, aspect 3/4-4/3),
    a horizontal flip half the time, ``ColorJitter(0.4, 0.4, 0.4)``, floats normalised with ImageNet's
    mean and std: ``(image (3, crop, crop) float32, label)``. The augmentation is torchvision's own
    functional kernels; its parameters and the label are drawn from a generator seeded by ``i``, as
    every zoo sample is (a sample does not depend on the process that makes it).

    The JPEGs (``bank`` of them, smooth random pictures of ``height`` x ``width`` px, each side
    drawn from ``size``'s range) are encoded once and held in memory, as a dataset's files in the page
    cache would be: all the per-sample work is the decode and the augmentation, 3.4 ms an image at
    full size on one core of an H200 host (2.8 ms with its 16 intra-op threads). On that H200, without
    workers, the fp32 step of B128 took 303 ms, 294 of them waiting for the batch (97%; at c20d74c)."""

    def __init__(
        self, length: int, size: tuple[int, int], crop: int, classes: int, seed: int, bank: int = 64, quality: int = 90
    ) -> None:
        from torchvision.io import encode_jpeg

        low, high = size
        if not 0 < crop <= low <= high:
            raise ValueError(f"expected 0 < crop <= the decoded sides' range {size}, found crop {crop}")
        self.length, self.crop, self.classes, self.seed = length, crop, classes, seed
        g = torch.Generator().manual_seed(seed)
        self.jpegs: list[torch.Tensor] = []  # encoded bytes, uint8 (N,)
        for _ in range(bank):
            h, w = (int(v) for v in torch.randint(low, high + 1, (2,), generator=g))
            coarse = torch.rand(1, 3, max(2, h // 8), max(2, w // 8), generator=g)
            pixels = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]  # (3, h, w)
            self.jpegs.append(encode_jpeg(pixels.mul(255).round().to(torch.uint8), quality=quality))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import decode_jpeg
        from torchvision.transforms.v2 import functional as TF

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = decode_jpeg(self.jpegs[index % len(self.jpegs)])  # (3, H, W) uint8
        H, W = image.shape[-2:]
        top, left, h, w = self._crop_box(H, W, g)
        image = TF.resized_crop(image, top, left, h, w, [self.crop, self.crop], antialias=True)  # (3, crop, crop)
        if torch.rand((), generator=g) < 0.5:
            image = TF.horizontal_flip(image)
        brightness, contrast, saturation = (float(f) for f in torch.empty(3).uniform_(0.6, 1.4, generator=g))
        image = TF.adjust_saturation(TF.adjust_contrast(TF.adjust_brightness(image, brightness), contrast), saturation)
        image = TF.normalize(TF.to_dtype(image, torch.float32, scale=True), IMAGENET_MEAN, IMAGENET_STD)
        return image, int(torch.randint(0, self.classes, (), generator=g))

    @staticmethod
    def _crop_box(H: int, W: int, g: torch.Generator) -> tuple[int, int, int, int]:
        """``RandomResizedCrop``'s box (torchvision's ``get_params``, drawn from ``g``): up to 10 tries
        at an area of 8-100% of the image with an aspect ratio of 3/4-4/3 (log-uniform), else the
        central crop of the ratio clamped to that range."""
        area, log_ratio = H * W, (math.log(3 / 4), math.log(4 / 3))
        for _ in range(10):
            target = area * float(torch.empty(()).uniform_(0.08, 1.0, generator=g))
            ratio = math.exp(float(torch.empty(()).uniform_(*log_ratio, generator=g)))
            w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < w <= W and 0 < h <= H:
                top = int(torch.randint(0, H - h + 1, (), generator=g))
                left = int(torch.randint(0, W - w + 1, (), generator=g))
                return top, left, h, w
        ratio = W / H
        w, h = (W, round(W / (3 / 4))) if ratio < 3 / 4 else (round(H * 4 / 3), H) if ratio > 4 / 3 else (W, H)
        return (H - h) // 2, (W - w) // 2, h, w


def augmented_image_loader(batch_size: int, size: tuple[int, int], crop: int, classes: int, seed: int = 0) -> DataLoader:
    """Batches of ``(images (B, 3, crop, crop) float32, labels (B,))`` decoded and augmented per
    sample, through a DataLoader as a hurried user leaves it: shuffled, and nothing else set (no
    workers, so the training process decodes every image between its steps; pageable memory)."""
    return DataLoader(
        _AugmentedJpegSamples(batch_size * EPOCH_BATCHES, size, crop, classes, seed), batch_size=batch_size, shuffle=True
    )


class _RandAugImages(Dataset):
    """Sample ``i``: one of ``bank`` decoded images, augmented as torchvision's documentation writes a training
    set's transforms, ``(image (3, crop, crop) float32, label)``::

        transforms.v2.Compose([RandomResizedCrop(crop, antialias=True), RandomHorizontalFlip(),
                               ToDtype(torch.float32, scale=True), Normalize(mean, std)])

    Every draw of the crop box and the flip comes from the global torch RNG, as the transforms make it: in a
    DataLoader worker, that worker's own stream (seeded from the loader's base seed and its id), so another
    ``num_workers`` draws other augmentations for the same index. The label of each index is drawn once.

    The images (smooth random pictures of ``height`` x ``width`` px, each side drawn from ``size``'s range,
    uint8 (3, H, W), as ``decode_image`` gives them) are made once, from ``seed``, and held in memory, as a
    dataset's decoded images in a cache would be: all the per-sample work is the augmentation."""

    def __init__(self, length: int, size: tuple[int, int], crop: int, classes: int, seed: int, bank: int = 64) -> None:
        from torchvision.transforms import v2

        low, high = size
        if not 0 < crop <= low <= high:
            raise ValueError(f"expected 0 < crop <= the decoded sides' range {size}, found crop {crop}")
        g = torch.Generator().manual_seed(seed)
        self.images: list[torch.Tensor] = []  # uint8 (3, H, W)
        for _ in range(bank):
            h, w = (int(v) for v in torch.randint(low, high + 1, (2,), generator=g))
            coarse = torch.rand(1, 3, max(2, h // 8), max(2, w // 8), generator=g)
            pixels = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)[0]  # (3, h, w)
            self.images.append(pixels.mul(255).round().to(torch.uint8))
        self.labels = torch.randint(0, classes, (length,), generator=g)
        self.transform = v2.Compose(
            [
                v2.RandomResizedCrop(crop, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.images[index % len(self.images)]), int(self.labels[index])


def randaug_image_loader(
    batch_size: int, size: tuple[int, int], crop: int, classes: int, seed: int = 0, workers: int = 2
) -> DataLoader:
    """Batches of ``(images (B, 3, crop, crop) float32, labels (B,))`` augmented per sample by torchvision's
    transforms drawing from the global RNG (:class:`_RandAugImages`), through a DataLoader as torchvision's
    documentation writes one: shuffled, ``num_workers=2``, nothing else set."""
    return DataLoader(
        _RandAugImages(batch_size * EPOCH_BATCHES, size, crop, classes, seed),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
    )


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

    def __init__(
        self, size: Size = "full", vocab_size: int | None = None, attn_implementation: str | None = None, lr: float = 3e-4
    ) -> None:
        _check_size(size)
        super().__init__(vocab_size or (50257 if size == "full" else 512), lr)
        from transformers import GPT2Config, GPT2LMHeadModel

        dims = (
            dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
            if size == "full"
            else dict(n_layer=2, n_embd=64, n_head=2, n_positions=64)
        )
        last = self.vocab_size - 1  # GPT-2's <|endoftext|>, inside a smaller vocabulary too
        self.model = GPT2LMHeadModel(
            GPT2Config(
                **dims, vocab_size=self.vocab_size, bos_token_id=last, eos_token_id=last, attn_implementation=attn_implementation
            )
        )


def enable_activation_checkpointing(model: Any) -> None:
    """The library's activation-checkpointing switch, as its users turn it on: ``activation_checkpointing_enable()``
    (transformers >= 5.2x) or ``gradient_checkpointing_enable()`` (earlier; deprecated since), its defaults
    (every decoder layer recomputed in the backward through ``torch.utils.checkpoint``, non-reentrant)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


class HFLlama(_HFCausalLM):
    """transformers' ``LlamaForCausalLM``: 400M parameters at ``size="full"`` (12 layers of width 1536,
    12 heads over 4 key-value heads, SwiGLU 4096, vocabulary 32000); 2 layers of width 64 at ``"tiny"``.
    ``checkpointing``: the library's activation checkpointing on (:func:`enable_activation_checkpointing`)."""

    def __init__(
        self,
        size: Size = "full",
        vocab_size: int | None = None,
        attn_implementation: str | None = None,
        lr: float = 3e-4,
        checkpointing: bool = False,
    ) -> None:
        _check_size(size)
        super().__init__(vocab_size or (32000 if size == "full" else 512), lr)
        from transformers import LlamaConfig, LlamaForCausalLM

        dims = (
            dict(
                hidden_size=1536,
                intermediate_size=4096,
                num_hidden_layers=12,
                num_attention_heads=12,
                num_key_value_heads=4,
                max_position_embeddings=2048,
            )
            if size == "full"
            else dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )
        self.model = LlamaForCausalLM(LlamaConfig(**dims, vocab_size=self.vocab_size, attn_implementation=attn_implementation))
        if checkpointing:
            enable_activation_checkpointing(self.model)


class _HFDictBatches(pl.LightningModule):
    """A Hugging Face model fed whole dict batches, its loss computed from their ``labels``
    (``self.model(**batch).loss``)."""

    model: Any

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss


def _adamw_linear_warmup(module: pl.LightningModule, lr: float, weight_decay: float, warmup: float) -> dict[str, Any]:
    """The optimization of transformers' example scripts (``run_glue_no_trainer.py``,
    ``run_summarization_no_trainer.py``): AdamW, without weight decay on biases and LayerNorm weights;
    ``get_linear_schedule_with_warmup`` over the fit's optimizer steps (Lightning's
    ``estimated_stepping_batches``), warming up over the first ``warmup`` of them, stepped after each."""
    from transformers import get_linear_schedule_with_warmup

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    total = int(module.trainer.estimated_stepping_batches)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=int(warmup * total), num_training_steps=total)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: BERT's dimensions per size: BERT-base at "full", 2 layers of width 64 at "tiny"; and its vocabulary
_BERT_DIMS: dict[Size, dict[str, int]] = {
    "full": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512
    ),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, max_position_embeddings=64),
}
_BERT_VOCAB: dict[Size, int] = {"full": 30522, "tiny": 512}


class HFBertMLM(_HFDictBatches):
    """transformers' ``BertForMaskedLM`` on masked-LM batches (``self.model(**batch)``): BERT-base
    (110M) at ``size="full"``, 2 layers of width 64 at ``"tiny"``; AdamW as in BERT's recipe."""

    #: BERT's [MASK] token id
    MASK_ID = 103

    def __init__(
        self, size: Size = "full", vocab_size: int | None = None, attn_implementation: str | None = None, lr: float = 1e-4
    ) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        _check_size(size)
        self.vocab_size, self.lr = vocab_size or _BERT_VOCAB[size], lr
        self.model = BertForMaskedLM(
            BertConfig(**_BERT_DIMS[size], vocab_size=self.vocab_size, attn_implementation=attn_implementation)
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class HFBertClassifier(_HFDictBatches):
    """transformers' ``BertForSequenceClassification`` (``num_labels`` classes) on texts of varying
    length that ``DataCollatorWithPadding`` padded to each batch's longest (``self.model(**batch)``):
    BERT-base (110M) at ``size="full"``, 2 layers of width 64 at ``"tiny"``; trained as the library's
    text-classification example trains it: AdamW at 2e-5 and a linear schedule with warmup, stepped
    every optimizer step."""

    def __init__(
        self,
        size: Size = "full",
        vocab_size: int | None = None,
        attn_implementation: str | None = None,
        num_labels: int = 2,
        lr: float = 2e-5,
        weight_decay: float = 0.01,
        warmup: float = 0.1,
    ) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        _check_size(size)
        self.vocab_size, self.num_labels = vocab_size or _BERT_VOCAB[size], num_labels
        self.lr, self.weight_decay, self.warmup = lr, weight_decay, warmup
        self.model = BertForSequenceClassification(
            BertConfig(
                **_BERT_DIMS[size], vocab_size=self.vocab_size, num_labels=num_labels, attn_implementation=attn_implementation
            )
        )

    def configure_optimizers(self) -> dict[str, Any]:
        return _adamw_linear_warmup(self, self.lr, self.weight_decay, self.warmup)


class HFT5(_HFDictBatches):
    """transformers' ``T5ForConditionalGeneration`` on summarization-style batches
    (``self.model(**batch)``; the model shifts ``labels`` right into the decoder's inputs): t5-small's
    shape at ``size="full"`` (60M parameters: width 512, 6+6 layers, 8 heads, feed-forward 2048,
    vocabulary 32128), 2+2 layers of width 64 at ``"tiny"``; trained as the library's summarization and
    translation examples train it: AdamW (their default learning rate, 5e-5) and a linear schedule with
    warmup, stepped every optimizer step."""

    def __init__(
        self,
        size: Size = "full",
        vocab_size: int | None = None,
        attn_implementation: str | None = None,
        lr: float = 5e-5,
        weight_decay: float = 0.01,
        warmup: float = 0.1,
    ) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        _check_size(size)
        dims = (
            dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8)
            if size == "full"
            else dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2)
        )
        self.vocab_size = vocab_size or (32128 if size == "full" else 512)
        self.lr, self.weight_decay, self.warmup = lr, weight_decay, warmup
        self.model = T5ForConditionalGeneration(
            T5Config(
                **dims,
                vocab_size=self.vocab_size,
                pad_token_id=_Seq2SeqSamples.PAD,
                eos_token_id=_Seq2SeqSamples.EOS,
                decoder_start_token_id=_Seq2SeqSamples.PAD,
                attn_implementation=attn_implementation,
            )
        )

    def configure_optimizers(self) -> dict[str, Any]:
        return _adamw_linear_warmup(self, self.lr, self.weight_decay, self.warmup)


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


class RNNModel(nn.Module):
    """The PyTorch examples' word-language model (``word_language_model/model.py``) as an LSTM:
    embedding, dropout, ``nn.LSTM``, dropout, a linear decoder whose weight is the embedding's
    (``--tied``), log-probabilities over the vocabulary. Batch-first, where the example runs its
    (T, B) batches time-first: the zoo's batches come from a DataLoader, (B, T)."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5, tie_weights: bool = True) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError(f"tied weights need nhid == ninp, found nhid={nhid}, ninp={ninp}")
            self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(
        self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = self.drop(self.encoder(input))  # (B, T, ninp)
        output, hidden = self.rnn(emb, hidden)  # (B, T, nhid); hidden None: zeros
        decoded = self.decoder(self.drop(output)).view(-1, self.ntoken)  # (B*T, ntoken)
        return F.log_softmax(decoded, dim=1), hidden


class LSTMLanguageModel(pl.LightningModule):
    """The PyTorch examples' word-language LSTM (:class:`RNNModel`) trained as the example's ``main.py``
    trains it: NLL of its log-probabilities, SGD at learning rate 20, the gradients' norm clipped to
    0.25 (in ``configure_gradient_clipping``, so it holds in a Trainer built without
    ``gradient_clip_val``), the learning rate divided by 4 when the loss stops improving
    (``ReduceLROnPlateau`` at each epoch's end, on the training loss: the zoo has no validation set).
    At ``size="full"`` the example's large configuration on WikiText-2's vocabulary (33278 tokens;
    embedding and 2 LSTM layers 1500 wide, dropout 0.65, tied decoder: 86M parameters), at ``"tiny"``
    width 32. Every batch of 35-token sequences (the example's ``bptt``) starts from a zero hidden
    state: the example carries the state (detached) from one batch to the next because its batches
    continue one another; the zoo's, shuffled samples, do not."""

    def __init__(self, size: Size = "full", vocab_size: int | None = None, lr: float = 20.0, clip: float = 0.25) -> None:
        super().__init__()
        _check_size(size)
        width, dropout = (1500, 0.65) if size == "full" else (32, 0.2)
        self.vocab_size, self.lr, self.clip = vocab_size or (33278 if size == "full" else 512), lr, clip
        self.model = RNNModel(self.vocab_size, width, width, nlayers=2, dropout=dropout, tie_weights=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        output, _ = self.model(inputs)
        loss = F.nll_loss(output, targets.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.25, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "epoch", "monitor": "train_loss"}}


# -- a GAN trained by hand ---------------------------------------------------------------------------


def _dcgan_init(module: nn.Module) -> None:
    """DCGAN's initialisation: convolutions from N(0, 0.02), batch-norm scales from N(1, 0.02)."""
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, nn.BatchNorm2d):
        nn.init.normal_(module.weight, 1.0, 0.02)
        nn.init.zeros_(module.bias)


def dcgan_generator(latent: int, width: int, image_size: int) -> nn.Sequential:
    """DCGAN's generator: a latent vector (B, latent, 1, 1) up to (B, 3, S, S) images in [-1, 1] by
    4x4 transposed convolutions doubling the side, batch norm and ReLU between them."""
    doublings = int(math.log2(image_size)) - 3  # 4 -> ... -> S/2 in the middle, the last layer to S
    mult = 2**doublings
    layers: list[nn.Module] = [
        nn.ConvTranspose2d(latent, width * mult, 4, 1, 0, bias=False),
        nn.BatchNorm2d(width * mult),
        nn.ReLU(True),
    ]
    for _ in range(doublings):
        layers += [
            nn.ConvTranspose2d(width * mult, width * mult // 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width * mult // 2),
            nn.ReLU(True),
        ]
        mult //= 2
    layers += [nn.ConvTranspose2d(width, 3, 4, 2, 1, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def dcgan_discriminator(width: int, image_size: int) -> nn.Sequential:
    """DCGAN's discriminator: 4x4 strided convolutions halving the side, batch norm and leaky ReLU,
    down to one logit per image (B,)."""
    halvings = int(math.log2(image_size)) - 3
    layers: list[nn.Module] = [nn.Conv2d(3, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
    mult = 1
    for _ in range(halvings):
        layers += [
            nn.Conv2d(width * mult, width * mult * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width * mult * 2),
            nn.LeakyReLU(0.2, True),
        ]
        mult *= 2
    layers += [nn.Conv2d(width * mult, 1, 4, 1, 0, bias=False), nn.Flatten(0)]
    return nn.Sequential(*layers)


class DCGAN(pl.LightningModule):
    """The DCGAN of PyTorch's examples (``dcgan/main.py``: 64 px images, a 100-d latent, 64 filters,
    Adam at 2e-4 with beta1 0.5 for both nets), trained as Lightning's GAN example trains one: manual
    optimization (``automatic_optimization = False``), the generator's and then the discriminator's
    optimizer toggled, stepped and zeroed by hand in ``training_step``, both losses logged. The losses
    take logits (``binary_cross_entropy_with_logits``; the example's ``Sigmoid`` + ``BCELoss`` cannot
    run under autocast). At ``size="tiny"``: 16 px, an 8-d latent, 8 filters."""

    def __init__(self, size: Size = "full", lr: float = 2e-4) -> None:
        super().__init__()
        _check_size(size)
        self.automatic_optimization = False
        self.image_size, self.latent, width = (64, 100, 64) if size == "full" else (16, 8, 8)
        self.lr = lr
        self.generator = dcgan_generator(self.latent, width, self.image_size)
        self.discriminator = dcgan_discriminator(width, self.image_size)
        self.generator.apply(_dcgan_init)
        self.discriminator.apply(_dcgan_init)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, _ = batch
        real = images.float().div(127.5).sub(1.0)  # uint8 to [-1, 1], the generator's range
        opt_g, opt_d = self.optimizers()
        n = real.shape[0]
        z = torch.randn(n, self.latent, 1, 1, device=self.device)
        ones, zeros = torch.ones(n, device=self.device), torch.zeros(n, device=self.device)

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return [
            torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr, betas=betas),
        ]


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

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss: cross-entropy (models trained with another override this)."""
        return F.cross_entropy(logits, labels)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.loss(self.model(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class _TimmClassifier(_ImageClassifier):
    """A timm model built by name (``arch``), with ``tiny`` overriding its dimensions at
    ``size="tiny"``; AdamW with weight decay 0.05, as in the ViT and ConvNeXt recipes (MobileNetV3
    trains with its own)."""

    arch: ClassVar[str]
    tiny: ClassVar[dict[str, Any]]

    def __init__(self, size: Size, classes: int, lr: float) -> None:
        super().__init__()
        timm = _library("timm", type(self).__name__)
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


class TimmMobileNetV3(_TimmClassifier):
    """timm's ``mobilenetv3_large_100`` at 224 px (5.5M parameters: inverted residuals of depthwise
    convolutions with BatchNorm, squeeze-excite, hard-swish); at ``size="tiny"`` the same model at a
    third of its depth (``depth_multiplier=0.3``). Trained as timm's ``train.py`` trains it with
    ``--opt sgd --smoothing 0.1 --sched cosine --sched-on-updates``: ``create_optimizer_v2`` (SGD with
    Nesterov momentum 0.9, weight decay 1e-5 on all but biases and norms), label-smoothing
    cross-entropy, timm's ``CosineLRScheduler`` with its warmup (5 of 300 epochs' worth) over the fit's
    optimizer steps. timm's scheduler is not torch's, so Lightning steps it through
    ``lr_scheduler_step`` (as Lightning's documentation does for it). ``lr`` is for a batch of 256
    images (the zoo's builder scales it to the batch, as timm's ``train.py`` does)."""

    arch = "mobilenetv3_large_100"
    tiny = dict(depth_multiplier=0.3)

    def __init__(
        self,
        size: Size = "full",
        classes: int = 1000,
        lr: float = 0.1,
        weight_decay: float = 1e-5,
        smoothing: float = 0.1,
        warmup: float = 5 / 300,
    ) -> None:
        super().__init__(size, classes, lr)
        from timm.loss import LabelSmoothingCrossEntropy

        self.weight_decay, self.warmup = weight_decay, warmup
        self.criterion = LabelSmoothingCrossEntropy(smoothing=smoothing)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.criterion(logits, labels)

    def configure_optimizers(self) -> dict[str, Any]:  # type: ignore[override]
        from timm.optim import create_optimizer_v2
        from timm.scheduler import CosineLRScheduler

        optimizer = create_optimizer_v2(self.model, opt="sgd", lr=self.lr, weight_decay=self.weight_decay, momentum=0.9)
        total = int(self.trainer.estimated_stepping_batches)
        scheduler = CosineLRScheduler(
            optimizer, t_initial=total, warmup_t=int(self.warmup * total), warmup_lr_init=1e-5, t_in_epochs=False
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step_update(num_updates=self.global_step)  # the optimizer steps taken, this one included


class TorchvisionResNet50(_ImageClassifier):
    """torchvision's ``resnet50``; at ``size="tiny"`` its bottleneck blocks, one per stage; SGD with
    momentum as in torchvision's recipe."""

    def __init__(self, size: Size = "full", classes: int = 1000, lr: float = 0.1) -> None:
        super().__init__()
        torchvision = _library("torchvision", type(self).__name__)
        from torchvision.models.resnet import Bottleneck, ResNet

        _check_size(size)
        self.model = (
            torchvision.models.resnet50(weights=None, num_classes=classes)
            if size == "full"
            else ResNet(Bottleneck, [1, 1, 1, 1], num_classes=classes)
        )
        self.lr = lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


class TorchvisionResNet18(_ImageClassifier):
    """torchvision's ``resnet18``; at ``size="tiny"`` its basic blocks, one per stage; SGD with
    momentum as in torchvision's recipe. The zoo feeds it images decoded and augmented per sample
    on the CPU (:func:`augmented_image_loader`, :func:`randaug_image_loader`), already floats:
    ``on_after_batch_transfer`` passes them on."""

    def __init__(self, size: Size = "full", classes: int = 1000, lr: float = 0.1) -> None:
        super().__init__()
        torchvision = _library("torchvision", type(self).__name__)
        from torchvision.models.resnet import BasicBlock, ResNet

        _check_size(size)
        self.model = (
            torchvision.models.resnet18(weights=None, num_classes=classes)
            if size == "full"
            else ResNet(BasicBlock, [1, 1, 1, 1], num_classes=classes)
        )
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

    def build(
        self, size: Size = "full", *, batch_size: int | None = None, seed: int = 0, **options: Any
    ) -> tuple[pl.LightningModule, DataLoader]:
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


def _t5(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    module = HFT5(size, **options)
    workers = TOKEN_WORKERS if size == "full" else 0
    source_len, target_len = {"full": (512, 128), "tiny": (32, 8)}[size]
    return module, seq2seq_loader(batch_size, source_len, target_len, module.vocab_size, workers, seed)


def _bert_classifier(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    module = HFBertClassifier(size, **options)
    workers = TOKEN_WORKERS if size == "full" else 0
    min_len, max_len = {"full": (32, 512), "tiny": (8, 32)}[size]
    return module, text_classification_loader(batch_size, min_len, max_len, module.vocab_size, module.num_labels, workers, seed)


def _checkpointed_llama(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    return _causal_lm(HFLlama)(size, batch_size, seed, checkpointing=True, **options)


def _dcgan(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    module = DCGAN(size, **options)
    workers = IMAGE_WORKERS if size == "full" else 0
    return module, image_loader(batch_size, module.image_size, 10, workers, seed)


def _vision(cls: type[pl.LightningModule]) -> Builder:
    def make(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
        classes = options.pop("classes", 1000 if size == "full" else 10)
        module = cls(size, classes=classes, **options)
        workers = IMAGE_WORKERS if size == "full" else 0
        return module, image_loader(batch_size, 224 if size == "full" else 32, classes, workers, seed)

    return make


def _mobilenet(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    options.setdefault("lr", 0.1 * batch_size / 256)  # timm's train.py: SGD's base rate 0.1 scaled to the batch
    return _vision(TimmMobileNetV3)(size, batch_size, seed, **options)


def _augmented_resnet18(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    classes = options.pop("classes", 1000 if size == "full" else 10)
    module = TorchvisionResNet18(size, classes=classes, **options)
    # decoded sides of 256-448 px (ImageNet's photos are about 400 x 350) cropped to 224; tiny: 36-48 to 32
    decoded, crop = ((256, 448), 224) if size == "full" else ((36, 48), 32)
    return module, augmented_image_loader(batch_size, decoded, crop, classes, seed)


def _randaug_resnet18(size: Size, batch_size: int, seed: int, **options: Any) -> tuple[pl.LightningModule, DataLoader]:
    classes = options.pop("classes", 1000 if size == "full" else 10)
    module = TorchvisionResNet18(size, classes=classes, **options)
    # decoded sides of 256-448 px cropped to 224, as for tv-resnet18-augment; tiny: 36-48 to 32 (both with 2 workers)
    decoded, crop = ((256, 448), 224) if size == "full" else ((36, 48), 32)
    return module, randaug_image_loader(batch_size, decoded, crop, classes, seed)


_HF_SDPA = {"attn_implementation": "sdpa"}

ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("hf-gpt2", "transformers", "tokens", {"full": 16, "tiny": 4}, _causal_lm(HFGPT2), _HF_SDPA),
        ZooModel("hf-llama", "transformers", "tokens", {"full": 8, "tiny": 4}, _causal_lm(HFLlama), _HF_SDPA),
        # the same with the library's activation checkpointing on, at twice the batch it frees memory for
        ZooModel("hf-llama-ckpt", "transformers", "tokens", {"full": 16, "tiny": 4}, _checkpointed_llama, _HF_SDPA),
        ZooModel("hf-bert-mlm", "transformers", "tokens", {"full": 16, "tiny": 4}, _bert, _HF_SDPA),
        ZooModel("timm-vit", "timm", "samples", {"full": 64, "tiny": 4}, _vision(TimmViT)),
        ZooModel("timm-convnext", "timm", "samples", {"full": 64, "tiny": 4}, _vision(TimmConvNeXt)),
        ZooModel("tv-resnet50", "torchvision", "samples", {"full": 64, "tiny": 4}, _vision(TorchvisionResNet50)),
        # the demo's own sequence length (WikiText2's block_size=35); its batch of one is no benchmark
        ZooModel(
            "lightning-transformer",
            "lightning",
            "tokens",
            {"full": 64, "tiny": 4},
            _causal_lm(LightningDemoTransformer, {"full": 35, "tiny": 32}),
        ),
        ZooModel("nanogpt", "speedkit", "tokens", {"full": 16, "tiny": 4}, _nanogpt),
        # timm's per-GPU batch for these nets (its recipes: 512 over two GPUs)
        ZooModel("timm-mobilenetv3", "timm", "samples", {"full": 256, "tiny": 4}, _mobilenet),
        # T5 has the library's SDPA switch (T5PreTrainedModel._supports_sdpa: True in transformers 5.17 and 5.24)
        ZooModel("hf-t5", "transformers", "tokens", {"full": 16, "tiny": 4}, _t5, _HF_SDPA),
        ZooModel("hf-bert-cls", "transformers", "tokens", {"full": 16, "tiny": 4}, _bert_classifier, _HF_SDPA),
        # the example's bptt, 35 tokens, at both sizes
        ZooModel("lstm-lm", "torch", "tokens", {"full": 64, "tiny": 4}, _causal_lm(LSTMLanguageModel, {"full": 35, "tiny": 35})),
        # data-bound: every image decoded and augmented in the training process (its loader has no workers)
        ZooModel("tv-resnet18-augment", "torchvision", "samples", {"full": 128, "tiny": 4}, _augmented_resnet18),
        # data-bound as users write it: torchvision's transforms drawing from the global RNG, in 2 loader workers
        ZooModel("tv-resnet18-randaug", "torchvision", "samples", {"full": 128, "tiny": 4}, _randaug_resnet18),
        # manual optimization: two optimizers stepped inside training_step (the DCGAN example's batch is 64)
        ZooModel("dcgan", "torch", "samples", {"full": 128, "tiny": 4}, _dcgan),
    )
}
