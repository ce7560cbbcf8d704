"""A GGUF file's tokenizer (and chat template), as transformers rebuilds it
from the file's metadata: seconds of work, done once and cached on disk,
keyed by the file's size and mtime, so later worker starts load it in a blink.

transformers 5 imports torch wherever it is installed (at the import of its
configuration classes), and a worker never computes with it: the worker
hides it (`hide_torch`: a worker starts ~1 s sooner and holds ~180 MB less).
The rebuild needs torch (transformers' GGUF reader imports it), so a worker
that hid it runs the rebuild in a child process (`python -m
kvmux.worker.gguf_tokenizer FILE INTO`) that writes the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvmux import logs, paths

log = logs.get("worker.gguf_tokenizer")


def hide_torch() -> None:
    """Before transformers is imported: it finds no torch, imports none (nor
    advises installing it, an advisory warning)."""
    sys.modules.setdefault("torch", None)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _torch_hidden() -> bool:
    return "torch" in sys.modules and sys.modules["torch"] is None


def load(path: Path):
    """The tokenizer of GGUF file `path`, from the cache where it is there."""
    from transformers import AutoTokenizer

    stat = path.stat()
    cached = paths.cache_dir() / "tokenizers" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        into = cached
    except OSError as exc:  # a read-only home: rebuilt beside us, read, removed
        log.debug("tokenizer_cache_skipped", reason=str(exc))
        into = Path(tempfile.mkdtemp(prefix="kvmux-tokenizer-")) / "tokenizer"
    _rebuild(path, into)
    try:
        return AutoTokenizer.from_pretrained(str(into), local_files_only=True)
    finally:
        if into is not cached:
            shutil.rmtree(into.parent, ignore_errors=True)


def _rebuild(path: Path, into: Path) -> None:
    if not _torch_hidden():
        return save(path, into)
    child = subprocess.run(
        [sys.executable, "-m", "kvmux.worker.gguf_tokenizer", str(path), str(into)], capture_output=True, text=True
    )
    if child.returncode != 0:
        tail = child.stderr.strip().splitlines()[-1:] or ["no message"]
        raise ValueError(f"could not read the tokenizer of {path.name}: {tail[0]}")


def save(path: Path, into: Path) -> None:
    """Rebuild the tokenizer of `path` and save it as directory `into`,
    atomically: a worker starting beside us sees all of it or nothing (where
    another won the race, theirs stays)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=into.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(into)
    except OSError as exc:  # another worker won the race
        log.debug("tokenizer_cache_raced", reason=str(exc))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    save(Path(sys.argv[1]), Path(sys.argv[2]))
