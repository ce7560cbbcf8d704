"""The models a daemon declares (`[[models]]`, or `--model` once or more),
as its local workers run them: each with its id, as its workers' READY
will say it (the file or directory name), the names an open may give it
(its id, its aliases, its packaged name), and the settings its workers run
with. Apart from models.py (which of them are resident) so that the
workers' supervisor (local.py), which models.py drives, needs only this."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmux import paths
from kvmux.settings import ModelSpec

from .config import BrokerConfig

RUNTIME_BYTES = 256 << 20  # a worker's memory beside its weights (Python, MLX, slabs), until measured


@dataclass(frozen=True)
class Declared:
    spec: ModelSpec
    path: Path | None  # None: the embedded model, the worker's default
    model_id: str
    names: frozenset[str]  # what OpenSession.model may say for it

    def worker_argv(self) -> list[str]:
        """Its `kvmux worker` options over the daemon's own."""
        spec, argv = self.spec, []
        for flag, value in (
            ("--model", self.path),
            ("--slabs", spec.slabs),
            ("--window", spec.window),
            ("--pipeline", spec.pipeline),
            ("--chat-template", spec.chat_template),
            ("--draft-model", spec.draft_model),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def estimate(self) -> int:
        """Bytes a worker of it takes before one was measured: its weights' files and RUNTIME_BYTES."""
        shown = self.path or paths.default_model_path()
        files = [shown] if shown is not None and shown.is_file() else list(shown.rglob("*")) if shown else []
        return sum(f.stat().st_size for f in files if f.is_file()) + RUNTIME_BYTES


def declare(cfg: BrokerConfig) -> list[Declared]:
    """The daemon's models, the default first: none for a broker without
    local workers (its workers bring their own); raises ValueError for a
    packaged model not installed (a file that is not a model is refused by
    its worker, as ever)."""
    if cfg.workers == 0:
        return []
    specs = cfg.models or [ModelSpec(path=cfg.model or "")]
    out = []
    for spec in specs:
        path = paths.model_file(spec.path) if spec.path else None
        shown = path if path is not None else paths.default_model_path()
        model_id = shown.name if shown is not None else "default"
        names = frozenset({model_id, *spec.aliases, *([spec.path] if spec.path in paths.PACKAGED_MODELS else [])})
        out.append(Declared(spec, path, model_id, names))
    ids = [d.model_id for d in out]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"models: {', '.join(twice)} declared more than once")
    return out
