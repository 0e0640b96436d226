"""A PyTorch DataLoader whose every mini-batch is one GetBatch request (client.data.GetBatchDataset).

Run from anywhere: python examples/torch_dataloader.py
Writes 64 tiny "images" (3x8x8 bytes plus a label byte) into a temporary folder and reads one shuffled
epoch of them with two worker processes. The same code reads s3:// objects: only the items change.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from shardfold.client.data import GetBatchDataset

NUM_SAMPLES = 64
SHAPE = (3, 8, 8)


def decode(data: bytes) -> tuple[torch.Tensor, int]:
    """One sample's bytes -> (image as float32 in [0, 1], label). Runs in the DataLoader's workers, so it
    lives at module level, where spawned workers can import it."""
    raw = np.frombuffer(data, dtype=np.uint8)
    image = torch.from_numpy(raw[1:].reshape(SHAPE).astype(np.float32) / 255.0)
    return image, int(raw[0])


def write_samples(folder: Path) -> list[str]:
    """Sample files under ``folder``; returns their keys (paths relative to it)."""
    rng = np.random.default_rng(0)
    keys = []
    for i in range(NUM_SAMPLES):
        key = f"train/{i:05d}.bin"
        label = np.uint8(i % 10)
        pixels = rng.integers(0, 256, size=SHAPE, dtype=np.uint8)
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(label.tobytes() + pixels.tobytes())
        keys.append(key)
    return keys


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="shardfold-example-samples-") as tmp:
        folder = Path(tmp)
        keys = write_samples(folder)
        print(f"wrote {len(keys)} samples under {folder}")

        # Keys are resolved against root once, here (default root: the store, SHARDFOLD_HOME); items may
        # also be full file:// or s3:// URIs, byte ranges or TAR members, as in a getbatch spec.
        dataset = GetBatchDataset(keys, decode=decode, root=folder.as_uri())
        print(f"dataset of {len(dataset)} items, first: {dataset.items[0].uri}")

        # The sampler shuffles indices; the DataLoader then calls dataset.__getitems__ once per batch, so
        # each batch of 16 is a single ordered GetBatch request instead of 16 separate reads. "spawn"
        # (the default on macOS and Windows) re-imports this script in each worker: hence the
        # `if __name__ == "__main__":` guard below.
        loader = DataLoader(
            dataset, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context="spawn"
        )
        seen = 0
        for step, (images, labels) in enumerate(loader):
            seen += len(labels)
            print(
                f"batch {step}: images {tuple(images.shape)} {images.dtype}, labels {tuple(labels.shape)}"
                f" {labels[:6].tolist()}..., mean pixel {images.mean():.3f}"
            )
        print(f"one epoch: {seen} samples in {len(loader)} batches")
        assert seen == NUM_SAMPLES


if __name__ == "__main__":
    main()
