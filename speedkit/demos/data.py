"""Synthetic data modules: deterministic random batches, generated on the fly on the CPU.

Each *batch* is generated from a generator seeded by its index, so any two loaders over the same
module yield the same batches, and making one costs one small random draw (cheap next to a step).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class _TokenBatches(Dataset):
    """Item ``i`` is batch ``i``: ``(inputs (B, T), targets (B, T))``, targets shifted by one token."""

    def __init__(self, batches: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.batches, self.batch_size, self.seq_len, self.vocab_size, self.seed = batches, batch_size, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        seq = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class _VectorBatches(Dataset):
    """Item ``i`` is batch ``i``: ``(x (B, F) float32, y (B,) int64)``."""

    def __init__(self, batches: int, batch_size: int, features: int, classes: int, seed: int) -> None:
        self.batches, self.batch_size, self.features, self.classes, self.seed = batches, batch_size, features, classes, seed

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.batch_size, self.features, generator=g), torch.randint(
            0, self.classes, (self.batch_size,), generator=g
        )


class _ImageSamples(Dataset):
    """Sample ``i``: ``(image (3, H, W) float32, label)``, drawn on the CPU from a generator seeded by ``i``
    (real per-sample CPU work, as decoding or augmenting would be)."""

    def __init__(self, length: int, size: int, classes: int, seed: int) -> None:
        self.length, self.size, self.classes, self.seed = length, size, classes, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(3, self.size, self.size, generator=g), int(torch.randint(0, self.classes, (), generator=g))


class SyntheticTokens(pl.LightningDataModule):
    """Random token sequences for language models: batches of ``(inputs, targets)``, each (B, T).

    Args:
        batch_size: sequences per batch.
        seq_len: tokens per sequence (T).
        vocab_size: token ids are drawn uniformly from ``[0, vocab_size)``.
        length: sequences per epoch (rounded down to whole batches).
        num_workers: DataLoader worker processes.
        pin_memory: DataLoader ``pin_memory`` (left off: a naive user's loader).
        seed: base seed of the per-index generators.
    """

    def __init__(
        self,
        batch_size: int = 8,
        seq_len: int = 64,
        vocab_size: int = 512,
        length: int = 4096,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("vocab_size", vocab_size), ("length", length)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        if length < batch_size:
            raise ValueError(f"length ({length}) must be >= batch_size ({batch_size})")
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size
        self.length, self.num_workers, self.pin_memory, self.seed = length, num_workers, pin_memory, seed

    def train_dataloader(self) -> DataLoader:
        ds = _TokenBatches(self.length // self.batch_size, self.batch_size, self.seq_len, self.vocab_size, self.seed)
        # batch_size=None: the dataset yields whole batches
        return DataLoader(ds, batch_size=None, shuffle=False, num_workers=self.num_workers, pin_memory=self.pin_memory)


class SyntheticVectors(pl.LightningDataModule):
    """Random feature vectors with class labels: batches of ``(x (B, F), y (B,))``."""

    def __init__(
        self,
        batch_size: int = 64,
        features: int = 256,
        classes: int = 10,
        length: int = 65536,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("features", features), ("classes", classes), ("length", length)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        if length < batch_size:
            raise ValueError(f"length ({length}) must be >= batch_size ({batch_size})")
        self.batch_size, self.features, self.classes = batch_size, features, classes
        self.length, self.num_workers, self.pin_memory, self.seed = length, num_workers, pin_memory, seed

    def train_dataloader(self) -> DataLoader:
        ds = _VectorBatches(self.length // self.batch_size, self.batch_size, self.features, self.classes, self.seed)
        return DataLoader(ds, batch_size=None, shuffle=False, num_workers=self.num_workers, pin_memory=self.pin_memory)


class SyntheticImages(pl.LightningDataModule):
    """Random fp32 images with class labels, made per sample by DataLoader workers, shuffled: the
    loader of a vision model as people write it.

    Args:
        batch_size: images per batch.
        size: height and width (224 for ImageNet-style models).
        classes: labels are drawn from ``[0, classes)``.
        length: images per epoch.
        num_workers, pin_memory, persistent_workers: the DataLoader's.
        seed: base seed of the per-sample generators.
    """

    def __init__(
        self,
        batch_size: int = 64,
        size: int = 224,
        classes: int = 1000,
        length: int = 16384,
        num_workers: int = 4,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("size", size), ("classes", classes), ("length", length)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        self.batch_size, self.size, self.classes, self.length = batch_size, size, classes, length
        self.num_workers, self.pin_memory, self.persistent_workers, self.seed = num_workers, pin_memory, persistent_workers, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            _ImageSamples(self.length, self.size, self.classes, self.seed),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers and self.num_workers > 0,
        )


class _JpegSamples(Dataset):
    """Sample ``i``: a JPEG decoded with PIL, randomly cropped and flipped, normalized to a float
    (3, crop, crop) tensor, and its label. The JPEG bytes are made once (smooth random images); the
    augmentation draws from a generator seeded by ``i``, so a sample does not depend on which process
    makes it (the worker count may change without changing any sample)."""

    def __init__(self, length: int, size: int, crop: int, classes: int, seed: int, distinct: int = 64) -> None:
        import io

        from PIL import Image

        self.length, self.size, self.crop, self.classes, self.seed = length, size, crop, classes, seed
        g = torch.Generator().manual_seed(seed)
        self.jpegs: list[bytes] = []
        for _ in range(min(distinct, length)):
            small = torch.rand(3, size // 8, size // 8, generator=g)
            image = torch.nn.functional.interpolate(small[None], size=(size, size), mode="bilinear", align_corners=False)[0]
            pixels = (image.clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).contiguous().numpy()
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            self.jpegs.append(buffer.getvalue())
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import io

        import numpy as np
        from PIL import Image

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = Image.open(io.BytesIO(self.jpegs[index % len(self.jpegs)])).convert("RGB")
        pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (3, H, W) uint8
        top, left = (int(v) for v in torch.randint(0, self.size - self.crop + 1, (2,), generator=g))
        pixels = pixels[:, top : top + self.crop, left : left + self.crop]
        if torch.rand((), generator=g) < 0.5:
            pixels = pixels.flip(-1)
        x = (pixels.float() / 255 - self.mean) / self.std
        return x, int(torch.randint(0, self.classes, (), generator=g))


class DecodedImages(pl.LightningDataModule):
    """A data-bound image loader: JPEGs decoded, cropped, flipped and normalized per sample on the CPU,
    shuffled (global RNG), loaded the way a naive script does (no workers, not pinned).

    Args:
        batch_size, size (decoded side), crop (the model's input side), classes, length: the data.
        num_workers, pin_memory: the DataLoader's (0 and False: the naive loader).
        resident: the bound: ``batches`` batches made once, kept on ``device``, served in a loop
            (no decoding, no copy: what any loader can at best approach).
        seed: of the images, the labels and the augmentation (the shuffle draws from the global RNG).
    """

    def __init__(
        self,
        batch_size: int = 128,
        size: int = 144,
        crop: int = 128,
        classes: int = 100,
        length: int = 16384,
        num_workers: int = 0,
        pin_memory: bool = False,
        resident: bool = False,
        batches: int = 16,
        device: str = "cuda",
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("batch_size", batch_size), ("crop", crop), ("classes", classes), ("length", length)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, found {value}")
        if crop > size:
            raise ValueError(f"crop ({crop}) must be <= size ({size})")
        self.batch_size, self.size, self.crop, self.classes, self.length = batch_size, size, crop, classes, length
        self.num_workers, self.pin_memory, self.resident, self.batches = num_workers, pin_memory, resident, batches
        self.device, self.seed = device, seed

    def dataset(self) -> Dataset:
        return _JpegSamples(self.length, self.size, self.crop, self.classes, self.seed)

    def train_dataloader(self) -> DataLoader | _Resident:
        if self.resident:
            loader = DataLoader(self.dataset(), batch_size=self.batch_size, shuffle=False, drop_last=True)
            made = []
            for batch in loader:
                made.append(tuple(t.to(self.device) for t in batch))
                if len(made) == self.batches:
                    break
            return _Resident(made, self.length // self.batch_size)
        # shuffled from the global RNG (seed_everything), as a naive script does
        return DataLoader(
            self.dataset(),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )


class _Resident:
    """``length`` batches per epoch, cycling through ``batches`` already on the device."""

    def __init__(self, batches: list, length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return (self.batches[i % len(self.batches)] for i in range(self.length))
