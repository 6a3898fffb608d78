"""Write ``data.jsonl`` from real text: sentences of the Lee news corpus (gensim's test
data, ``lee_background.cor``, Latin-1), each as one record ``{"text": ..., "inputs": {"byte_ids": [...],
"attention_mask": [...]}}`` of 64 bytes (cut or zero-padded) by :func:`model.encode`.

Run from this folder: ``../../.venv/bin/python make_data.py``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

LENGTH = 64
RECORDS = 320


def sentences() -> list[str]:
    import gensim

    corpus = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    out = []
    for doc in corpus.read_text(encoding="latin-1").splitlines():
        out += [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", doc) if len(s.strip()) > 20]
    return out


def main() -> None:
    from model import encode

    texts = sentences()[:RECORDS]
    feeds = encode(texts, LENGTH)
    with open(Path(__file__).parent / "data.jsonl", "w", encoding="utf-8") as fh:
        for i, text in enumerate(texts):
            inputs = {name: feeds[name][i].tolist() for name in ("byte_ids", "attention_mask")}
            fh.write(json.dumps({"text": text, "inputs": inputs}) + "\n")


if __name__ == "__main__":
    main()
