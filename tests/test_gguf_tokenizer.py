"""A GGUF's tokenizer without torch in the worker: transformers imports
torch wherever it is installed, and a worker never computes with it, so the
worker hides it; the one step that needs it, rebuilding a GGUF's tokenizer
from its metadata the first time, runs in a child process that fills the
cache (worker/gguf_tokenizer.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TEXT = "Hello world, naïve café: 12345!"

# As the worker does (worker/cli.py): torch hidden before transformers is imported.
HIDDEN = """
import json, sys
from pathlib import Path
from kvmux.worker import gguf_tokenizer
gguf_tokenizer.hide_torch()
tokenizer = gguf_tokenizer.load(Path(sys.argv[1]))
print(json.dumps({"ids": tokenizer.encode(sys.argv[2]), "template": tokenizer.chat_template,
                  "torch": sys.modules["torch"] is not None}))
"""


def hidden_load(model_path: Path, cache: Path) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", HIDDEN, str(model_path), TEXT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_shared_stacks_worker_has_no_torch(shared_stack):
    maps = Path(f"/proc/{shared_stack.workers[0].pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps


def test_a_cold_cache_is_filled_by_a_child_and_the_tokenizer_is_transformers_own(model_path, hf_tokenizer, tmp_path):
    """With torch hidden and no cache, the rebuild runs in a child with torch,
    the cache holds it, and the tokenizer equals transformers' own read of
    the file (tokens and chat template); a second load reads that cache."""
    expected = {"ids": hf_tokenizer.encode(TEXT), "template": hf_tokenizer.chat_template, "torch": False}
    assert hidden_load(model_path, tmp_path) == expected
    (cached,) = (tmp_path / "kvmux" / "tokenizers").iterdir()
    assert cached.name.startswith(model_path.stem) and (cached / "tokenizer.json").is_file()
    stamp = cached.stat().st_mtime_ns
    assert hidden_load(model_path, tmp_path) == expected
    assert [p.name for p in cached.parent.iterdir()] == [cached.name] and cached.stat().st_mtime_ns == stamp
