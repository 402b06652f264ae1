"""ps-prepare's image folders: class-per-folder images, resized and read into uint8 arrays mapped from disk (so that
memory does not hold the dataset), for prepare.py to normalise and cut into shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from worker.data.sources import Arrays, PrepareConfig, held_out_count

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def read_image_folder(root: Path, config: PrepareConfig, scratch: Path) -> Arrays:
    """A folder of class folders of images (train/ and test/ above them, or a split held out here) as uint8 arrays
    mapped from files under `scratch`, resized to --image-size square."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("image folders need Pillow: pip install pillow") from None
    splits = [root / "train", root / "test"] if (root / "train").is_dir() and (root / "test").is_dir() else [root]
    classes = tuple(sorted(p.name for p in splits[0].iterdir() if p.is_dir()))
    if not classes:
        raise ValueError(f"{root} has no class folders: expected {root}/CLASS/IMAGE (or train/ and test/ above them)")
    mode, channels = ("RGB", 3) if config.color == "rgb" else ("L", 1)
    size = config.image_size

    def listed(folder: Path) -> list[tuple[int, Path]]:
        files = [
            (label, p)
            for label, name in enumerate(classes)
            if (folder / name).is_dir()
            for p in sorted((folder / name).iterdir())
            if p.suffix.lower() in _IMAGE_SUFFIXES
        ]
        if not files:
            raise ValueError(f"{folder} holds no images ({', '.join(sorted(_IMAGE_SUFFIXES))})")
        return files

    def load(files: list[tuple[int, Path]], name: str) -> tuple[np.ndarray, np.ndarray]:
        """The images' pixels, resized, as uint8 (N, C, H, W) in a file mapped from disk: a quarter of float32's
        size, and out of memory, however many images there are."""
        pixels = np.lib.format.open_memmap(
            scratch / f"{name}.npy", mode="w+", dtype=np.uint8, shape=(len(files), channels, size, size)
        )
        todo = files
        if config.progress:  # decoding and resizing is the slow part of preparing an image folder
            from tqdm import tqdm

            todo = tqdm(files, desc=f"reading {name}", unit="image", dynamic_ncols=True)
        for i, (_, p) in enumerate(todo):
            try:
                with Image.open(p) as img:
                    a = np.asarray(img.convert(mode).resize((size, size), Image.Resampling.BILINEAR))
            except OSError as exc:
                raise ValueError(f"{p} is not an image Pillow can read: {exc}") from None
            pixels[i] = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
        return pixels, np.array([label for label, _ in files], dtype=np.int64)

    if len(splits) == 2:
        (x_train, y_train), (x_test, y_test) = load(listed(splits[0]), "train"), load(listed(splits[1]), "test")
    else:
        files = listed(root)
        order = np.random.default_rng(config.seed).permutation(len(files))
        n_test = held_out_count(len(files), config)
        x_test, y_test = load([files[i] for i in sorted(order[:n_test])], "test")
        x_train, y_train = load([files[i] for i in sorted(order[n_test:])], "train")
    return Arrays(root.name, "classification", x_train, y_train, x_test, y_test, len(classes), classes)
