"""A small tokenizer and text dataset for torchtitan's loaders, made on the spot.

torchtitan's configs point at ``tests/assets/tokenizer`` and ``tests/assets/c4_test``, which
its wheel does not ship. :func:`ensure_assets` writes stand-ins in the same formats, so its
own tokenizer and data loader run unchanged: a byte-level tokenizer (256 bytes plus begin and
end of text, within llama3 debugmodel's vocabulary); ``c4_test``, one JSON line per Python
standard-library source file (the same bytes on every machine); ``c4_test_short_docs``, the
same cut at blank lines, so packed rows hold several documents (for
``--autopp.per_document_positions``). Writing is idempotent and atomic (temporary file, then
rename), so every rank may call it at once."""

from __future__ import annotations

import json
import os
import sysconfig
import tempfile
from pathlib import Path

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def _write_atomic(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def tokenizer_json() -> str:
    """``tokenizer.json`` of a byte-level BPE without merges (one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    return tok.to_str(pretty=True)


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to ``char``."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    extra = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(extra)})
    return table[char]


def stdlib_documents(max_bytes: int) -> list[str]:
    """The standard library's .py files (sorted, tests and site-packages skipped) as texts."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        docs.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return docs


def paragraphs(texts: list[str]) -> list[str]:
    """``texts`` cut at blank lines: each non-blank paragraph one document, in order."""
    return [p for t in texts for p in t.split("\n\n") if p.strip()]


def ensure_assets(root: str | os.PathLike, *, max_bytes: int = 2 << 20) -> tuple[str, str]:
    """Write (or keep) the tokenizer and dataset under ``root``.

    Returns ``(tokenizer_dir, dataset_dir)``: pass them as torchtitan's ``hf_assets_path``
    and ``dataloader.dataset_path`` (dataset ``c4_test``); the short-documents dataset is
    ``<root>/c4_test_short_docs`` (dataset ``c4_test`` too).
    """
    root = Path(root)
    tok_dir, data_dir = root / "tokenizer", root / "c4_test"
    _write_atomic(tok_dir / "tokenizer.json", tokenizer_json())
    _write_atomic(tok_dir / "tokenizer_config.json", json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True},
        indent=2))
    docs = stdlib_documents(max_bytes)
    _write_atomic(data_dir / "data.json", "".join(json.dumps({"text": t}) + "\n" for t in docs))
    _write_atomic(root / "c4_test_short_docs" / "data.json",
                  "".join(json.dumps({"text": t}) + "\n" for t in paragraphs(docs)))
    return str(tok_dir), str(data_dir)


if __name__ == "__main__":
    import sys

    print(*ensure_assets(sys.argv[1] if len(sys.argv) > 1 else "outputs/autopp_assets"))
