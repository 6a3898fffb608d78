"""Labelled text-line crops made from real material, labels known by construction.

Sentences of the built-in ``lee_background`` news corpus (gensim's test data)
are word-wrapped into lines and rendered black on white with a real font
(DejaVu Sans, bundled with matplotlib); each crop is written upright (label
``0``) and turned by 180 degrees (label ``180``), as an ``images`` data source:
``<out>/<split>/0/<i>.png`` and ``<out>/<split>/180/<i>.png``.

Calibration and eval lines come from disjoint document ranges of the corpus,
each line text is used once across both, so no image can repeat between them.
PNG output is byte-deterministic for a given Pillow/FreeType and font.

Settings (:class:`RenderSettings`): font size 32 px, 4 px white padding, lines
of at most 28 characters (at least 12). The classifier's FP32 top-1 accuracy on
the default eval split (400 lines, 800 images) is 97.4 %: upright lines 100 %,
turned ones 94.75 % (every error is a turned line read as upright). Longer lines
are squeezed harder into its 48x192 input and get harder (first 200 lines at
32 px: 20 characters 100 %, 30 characters 97.8 %), so this is a meaningful,
not a saturated, baseline; Latin text is not near chance for this Chinese-trained model.

CLI: ``python -m pipeline.models.image_classification.render OUT [--eval-lines N]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import PipelineError

LABELS = ("0", "180")
FONT_FILE = "mpl-data/fonts/ttf/DejaVuSans.ttf"


@dataclass(frozen=True)
class RenderSettings:
    """How lines are made: font size (px), white padding (px), line length bounds (characters)."""

    font_size: int = 32
    padding: int = 4
    max_chars: int = 28
    min_chars: int = 12


@dataclass(frozen=True)
class Split:
    """One output folder: corpus documents ``[doc_start, doc_stop)``, at most ``max_lines`` lines."""

    name: str
    doc_start: int
    doc_stop: int
    max_lines: int


DEFAULT_SPLITS = (Split("calibration", 0, 100, 64), Split("eval", 150, 300, 400))


def font_path() -> Path:
    """DejaVuSans.ttf from the installed matplotlib, found without importing it.

    Raises:
        PipelineError: matplotlib (or its bundled font) is missing.
    """
    spec = importlib.util.find_spec("matplotlib")
    path = Path(list(spec.submodule_search_locations)[0]) / FONT_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise PipelineError(f"font {FONT_FILE} not found: install matplotlib (it bundles DejaVu Sans)")
    return path


def wrap(document: str, settings: RenderSettings) -> list[str]:
    """Word-wrap one document into lines of ``min_chars..max_chars`` characters
    (shorter leftovers and single words longer than ``max_chars`` are dropped)."""
    lines, current = [], ""
    for word in document.split():
        if current and len(current) + 1 + len(word) > settings.max_chars:
            lines.append(current)
            current = ""
        current = f"{current} {word}" if current else word
    lines.append(current)
    return [line for line in lines if settings.min_chars <= len(line) <= settings.max_chars]


def render_line(text: str, font, padding: int):
    """``text`` in black on white, tightly cropped plus ``padding``: an RGB ``PIL.Image``."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(text)
    image = Image.new("RGB", (right - left + 2 * padding, bottom - top + 2 * padding), "white")
    ImageDraw.Draw(image).text((padding - left, padding - top), text, fill="black", font=font)
    return image


def rotate_180(image):
    """The image turned by 180 degrees (exact pixel permutation, no resampling)."""
    from PIL import Image

    return image.transpose(Image.Transpose.ROTATE_180)


def split_lines(documents: list[str], splits: tuple[Split, ...], settings: RenderSettings) -> dict[str, list[str]]:
    """Line texts per split; a text already taken by an earlier split (or line) is skipped.

    Raises:
        PipelineError: two splits share documents, or a range reaches past the corpus.
    """
    spans = sorted((s.doc_start, s.doc_stop, s.name) for s in splits)
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise PipelineError(f"render splits {a!r} and {b!r} share corpus documents; valid: disjoint ranges")
    seen: set[str] = set()
    out = {}
    for s in splits:
        if not 0 <= s.doc_start < s.doc_stop <= len(documents):
            raise PipelineError(f"render split {s.name!r}: documents [{s.doc_start}, {s.doc_stop}) outside the "
                                f"corpus's {len(documents)}")
        picked: list[str] = []
        for doc in documents[s.doc_start:s.doc_stop]:
            for line in wrap(doc, settings):
                if line not in seen and len(picked) < s.max_lines:
                    seen.add(line)
                    picked.append(line)
        out[s.name] = picked
    return out


def write_split(folder: Path, lines: list[str], settings: RenderSettings) -> int:
    """Write ``folder/0/<i>.png`` (upright) and ``folder/180/<i>.png`` (turned); returns the image count."""
    from PIL import ImageFont

    font = ImageFont.truetype(str(font_path()), settings.font_size)
    for label in LABELS:
        (folder / label).mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(lines):
        image = render_line(text, font, settings.padding)
        image.save(folder / "0" / f"{i:05d}.png")
        rotate_180(image).save(folder / "180" / f"{i:05d}.png")
    return 2 * len(lines)


def generate(out: str | Path, splits: tuple[Split, ...] = DEFAULT_SPLITS,
             settings: RenderSettings = RenderSettings()) -> dict[str, int]:
    """Render every split under ``out`` (an ``images`` source folder each) and
    write ``out/render.json`` (settings, document ranges, line texts). Existing
    split folders are replaced. Returns images written per split.

    Raises:
        PipelineError: bad split ranges, or the corpus or font is missing.
    """
    import shutil

    from pipeline.sources.data import load

    documents = load({"type": "corpus", "name": "lee_background"}, None, "render").items()
    lines = split_lines(documents, splits, settings)
    out = Path(out)
    counts = {}
    for s in splits:
        shutil.rmtree(out / s.name, ignore_errors=True)
        counts[s.name] = write_split(out / s.name, lines[s.name], settings)
    record = {"corpus": "lee_background", "font": FONT_FILE, "settings": asdict(settings),
              "splits": [asdict(s) for s in splits], "lines": lines}
    (out / "render.json").write_text(json.dumps(record, indent=1) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    """CLI entry: render the calibration and eval folders. Exit 0, or 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m pipeline.models.image_classification.render",
                                description="Render labelled text-line crops (0 / 180 degrees) from lee_background.")
    p.add_argument("out", help="output folder (gets calibration/ and eval/)")
    p.add_argument("--calibration-lines", type=int, default=DEFAULT_SPLITS[0].max_lines)
    p.add_argument("--eval-lines", type=int, default=DEFAULT_SPLITS[1].max_lines)
    args = p.parse_args(argv)
    cal, ev = DEFAULT_SPLITS
    splits = (Split(cal.name, cal.doc_start, cal.doc_stop, args.calibration_lines),
              Split(ev.name, ev.doc_start, ev.doc_stop, args.eval_lines))
    try:
        counts = generate(args.out, splits)
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(" ".join(f"{k}: {v} images" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
