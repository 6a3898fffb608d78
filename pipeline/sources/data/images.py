"""An image folder whose subfolder names are the labels (the torchvision
``ImageFolder`` layout): sorted subfolder names are class indices 0, 1, ...

Images are PNG or JPEG files anywhere under a class folder, in sorted order of
class then relative path; the range counts images in that order. Hidden files
(``.DS_Store``) are skipped; any other file is an error, so no data is silently
left out.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.sources.data.base import Claim, DataError, Labeled, resolve, select

EXTENSIONS = (".png", ".jpg", ".jpeg")


def root(src) -> Path:
    return resolve(src, src.path, "path", folder=True)


def classes(src) -> list[str]:
    """Sorted subfolder names: the label of class index ``i`` is ``classes[i]``.

    Raises:
        DataError: the folder is missing or has no subfolder.
    """
    folder = root(src)
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise DataError(f"{src._where}.path: {folder} has no subfolders; valid: one subfolder of images per label")
    return names


def _listing(src) -> list[tuple[Path, int]]:
    folder = root(src)
    stray = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in EXTENSIONS)
    if stray:
        raise DataError(f"{src._where}.path: {stray[0]} is not in a label subfolder; valid: {folder}/<label>/<image>")
    out = []
    for index, name in enumerate(classes(src)):
        found = sorted(p for p in (folder / name).rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        bad = [p for p in found if p.suffix.lower() not in EXTENSIONS]
        if bad:
            raise DataError(f"{src._where}.path: {bad[0]} is not an image file; valid extensions: "
                            f"{', '.join(EXTENSIONS)}")
        if not found:
            raise DataError(f"{src._where}.path: label folder {folder / name} holds no images")
        out += [(p, index) for p in found]
    return out


def files(src) -> list[Path]:
    """Every image of the folder (labels come from the whole listing)."""
    return [p for p, _ in _listing(src)]


def load_image(src, path: Path):
    """The decoded image as an RGB ``PIL.Image.Image`` (``[H, W, 3]`` uint8 pixels).

    Raises:
        DataError: Pillow cannot decode the file; names it.
    """
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{src._where}.path: {path} cannot be decoded as an image ({e})") from None


def items(src) -> list[Labeled]:
    """``Labeled(image path, class index)`` for the images ``src.split``; each
    one is decoded once here, so a broken file fails before any stage work.

    Raises:
        DataError: the folder layout is wrong, an image in range cannot be
            decoded, or the split is empty or reaches past the images.
    """
    listing = _listing(src)
    start, stop = select(src, len(listing), "image", str(root(src)))
    for path, _ in listing[start:stop]:
        load_image(src, path)
    return [Labeled(p, i) for p, i in listing[start:stop]]


def claims(src) -> list[Claim]:
    listing = _listing(src)
    start, stop = select(src, len(listing), "image", str(root(src)))
    return [Claim(p.resolve(), "image", None) for p, _ in listing[start:stop]]


def describe(src) -> str:
    return f"image folder {src.path} (subfolder = label), images {src.split}"
