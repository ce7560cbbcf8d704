"""Settings declared once, as the fields of a msgspec Struct:
`name: Annotated[type, bounds, doc("help", stands_for)] = default`. A
command's typer options and their help (`with_options`), reading them from
TOML and options with errors that name the key (`load`), the command line
that passes them on (`Setting.argv`) and their table in docs/operations.md
(`Table`) all come from that one declaration, so none can drift from it.

`WorkerSettings` are the settings every worker takes: `kvmux worker` reads
them and `kvmux serve` passes its own on to its local workers, so both
commands share one declaration of each."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, NamedTuple, TypeVar, get_args, get_origin

import msgspec
import typer

from kvmux import paths
from kvmux.protocol import DECODE_ERRORS, DEFAULT_MAX_APPEND_TOKENS, DEFAULT_MAX_TOKENS_LIMIT, HEARTBEAT_INTERVAL_S

Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]

S = TypeVar("S", bound=msgspec.Struct)
F = TypeVar("F", bound=Callable[..., Any])


def doc(text: str, stands_for: str = "", envvar: str = "") -> msgspec.Meta:
    """A setting's help; where its default is "" or None, what that stands for
    (help and docs show it as the default); the environment variable its
    option may also come from."""
    extra = {key: value for key, value in (("stands_for", stands_for), ("envvar", envvar)) if value}
    return msgspec.Meta(description=text, extra=extra or None)


class WorkerSettings(msgspec.Struct, kw_only=True):
    """What a worker serves and how: `kvmux worker`'s settings that are
    `kvmux serve`'s too, for its local workers."""

    slabs: Annotated[AtLeastOne, doc("Sessions a worker holds at once, one KV slab each.")] = 4
    model: Annotated[
        str | None,
        doc(
            "The model a worker serves: GGUF file or mlx-lm directory (`kvmux serve`: or a packaged model's name;"
            " given more than once, a model each: `models`).",
            "embedded SmolLM2-135M-Instruct",
        ),
    ] = None
    chat_template: Annotated[
        str | None,
        doc(
            "Jinja chat template file, instead of the model's own (a base model's GGUF often has none).", "the model's"
        ),
    ] = None
    draft_model: Annotated[
        str | None, doc("Draft model for speculative decoding (GGUF or mlx-lm dir); its tokenizer must be the model's.")
    ] = None
    draft_quantized: Annotated[
        bool, doc("Keep the draft model's weights quantized (smaller; on a CPU they are otherwise dequantized).")
    ] = False
    batch_invariant: Annotated[
        bool,
        doc(
            "Pad every pass: a session's tokens bit-identical whatever shares its pass, at whatever that costs on"
            ' these kernels (otherwise: pad only where a decode step pays at most 5 %; docs/operations.md, "Speed'
            ' and exactness").'
        ),
    ] = False
    cpu_kernel: Annotated[
        Literal["auto", "avx512", "avx2", "scalar", "off"],
        doc(
            "CPU kernel for quantized weights, read as stored (auto: the CPU's best); off: float32 copies.",
            envvar="KVMUX_CPU_KERNEL",
        ),
    ] = "auto"
    cpu_products: Annotated[
        Literal["exact", "int8"],
        doc(
            "The CPU kernel's products: exact (float32) or int8 (llama.cpp's arithmetic: faster, ~0.5 % off"
            ' each product; docs/operations.md, "Speed and exactness").',
            envvar="KVMUX_CPU_PRODUCTS",
        ),
    ] = "exact"
    pipeline: Annotated[
        AtLeastOne,
        doc(
            "Processes (ranks) one worker is made of, each holding a consecutive range of the model's layers"
            " (mx.distributed's ring backend; `kvmux serve` starts them on this host, mlx.launch across hosts)."
        ),
    ] = 1
    state_dir: Annotated[
        str,
        doc(
            "The session store's directory, the broker's and its workers'.",
            "$KVMUX_STATE_DIR, else $XDG_STATE_HOME/kvmux, else ~/.local/state/kvmux (macOS: ~/Library/Application Support/kvmux)",
        ),
    ] = ""
    store: Annotated[
        str,
        doc(
            "Where sessions are kept: a Redis URL (redis://user:password@host:port/db, the user and password"
            " optional; rediss:// for TLS; unix:///path.sock?db=N) shared by workers on any host, or the state"
            " dir's directory, one host's.",
            "the state dir",
            envvar="KVMUX_STORE",
        ),
    ] = ""
    prefix_min_tokens: Annotated[
        Count,
        doc(
            "Shared prefixes: a new session's opening that shares at least this many tokens with an earlier"
            " one's is restored from their KV, stored for every worker (0: only pinned prefixes)."
        ),
    ] = 512
    prefix_memory_bytes: Annotated[
        Count, doc("Bytes of shared prefixes a worker keeps in memory, least recently used dropped first.")
    ] = 512 << 20
    prefix_store_bytes: Annotated[
        Count,
        doc(
            "Bytes of shared prefixes kept in the session store, least recently used evicted first, never a pinned one."
        ),
    ] = 4 << 30
    heartbeat_s: Annotated[
        float,
        msgspec.Meta(ge=0.05),
        doc("Heartbeat interval between the broker and its workers (and its quiet clients)."),
    ] = HEARTBEAT_INTERVAL_S
    max_tokens_limit: Annotated[AtLeastOne, doc("A worker answers `invalid_argument` for a larger max_tokens.")] = (
        DEFAULT_MAX_TOKENS_LIMIT
    )
    max_append_tokens: Annotated[
        AtLeastOne,
        doc("A worker answers `invalid_argument` for one append (or a generate's messages) longer than this."),
    ] = DEFAULT_MAX_APPEND_TOKENS

    def __post_init__(self) -> None:
        self.state_dir = self.state_dir or str(paths.state_dir())


class ModelSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One model `kvmux serve` runs workers for: a `[[models]]` table of its
    TOML, or a `--model` option (its path only). Unset fields take the
    daemon's own settings."""

    path: str  # a GGUF file, an mlx-lm directory, or a packaged model's name (paths.PACKAGED_MODELS)
    aliases: list[str] = []  # other names an open may give it (OpenSession.model)
    slabs: AtLeastOne | None = None
    window: AtLeastOne | None = None  # its workers' largest sliding window (`kvmux worker --window`)
    pipeline: AtLeastOne | None = None
    chat_template: str | None = None
    draft_model: str | None = None
    pinned: bool = False  # never unloaded (idle, or for the memory budget)


class Setting(NamedTuple):
    """One field of a settings Struct as a command's help and the docs show it."""

    name: str
    type: type | None  # what the command line parses (msgspec then checks it); None: TOML only
    choices: tuple[str, ...]  # a Literal's values
    help: str
    default: str  # as help and docs show it
    envvar: str  # where its option may also come from; "" for nowhere

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def option(self) -> str:
        """Its command-line option, "" if TOML only; a flag can be turned off
        too, over a TOML file's true."""
        if self.type is None:
            return ""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.type is bool else self.flag

    def argv(self, value: Any) -> list[str]:
        """The options that give it `value` on a command line: none for None,
        which leaves the default to the command."""
        if value is None:
            return []
        if self.type is bool:
            return [self.flag if value else f"--no-{self.flag[2:]}"]
        return [self.flag, str(value)]


@cache
def declared(struct: type[msgspec.Struct]) -> tuple[Setting, ...]:
    """`struct`'s fields as Settings, in its order (a base Struct's first).
    Every field is Annotated with its doc()."""
    return tuple(_setting(field) for field in msgspec.structs.fields(struct))


def _setting(field: msgspec.structs.FieldInfo) -> Setting:
    bare, *metas = get_args(field.type)
    (about,) = [meta for meta in metas if meta.description]
    extra = about.extra or {}
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    choices = get_args(bare) if get_origin(bare) is Literal else ()
    if choices:
        bare = str  # msgspec checks the choice and names them
    elif get_origin(bare) is UnionType:  # str | None
        (bare,) = [arg for arg in get_args(bare) if arg is not type(None)]
    parsed = bare if bare in (bool, int, float, str) else None  # a list is TOML only
    text = about.description + (f" One of: {', '.join(choices)}." if choices else "")
    shown = extra.get("stands_for") or _shown(default)
    return Setting(field.name, parsed, choices, text, shown, extra.get("envvar", ""))


def _shown(default: Any) -> str:
    if default in ("", None):
        return "none"
    if isinstance(default, bool):
        return str(default).lower()  # as TOML writes it
    return msgspec.json.encode(default).decode() if isinstance(default, list) else str(default)


def with_options(settings: tuple[Setting, ...]) -> Callable[[F], F]:
    """Give a command one typer option per setting, after its own parameters
    (typer reads them from its signature; the command takes them as
    **kwargs). Each defaults to None, "not given", so a TOML file's value or
    the declared default stands unless one is given."""

    def add(command: F) -> F:
        fixed = [p for p in inspect.signature(command).parameters.values() if p.kind is not p.VAR_KEYWORD]
        options = [
            inspect.Parameter(
                s.name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=s.type,
                default=typer.Option(None, s.option, help=s.help, show_default=s.default, envvar=s.envvar or None),
            )
            for s in settings
            if s.type is not None
        ]
        command.__signature__ = inspect.Signature([*fixed, *options])
        return command

    return add


class ConfigError(ValueError):
    """A config file or option a command cannot run with; the message says which."""


def load(struct: type[S], path: Path | None = None, **overrides: Any) -> S:
    """Read `path` (TOML) if given, apply the non-None `overrides`, validate."""
    raw: dict[str, Any] = {}
    where = "command line"
    if path is not None:
        where = str(path)
        try:
            raw = msgspec.toml.decode(Path(path).read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except DECODE_ERRORS as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    raw.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return msgspec.convert(raw, struct)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_explain(exc, struct)}") from None


def _explain(exc: msgspec.ValidationError, struct: type[msgspec.Struct]) -> str:
    # msgspec says "Expected `int` >= 1, got `0` - at `$.slabs`"; name the key plainly.
    text = str(exc)
    if " - at `$." not in text:
        return text
    message, _, key = text.rpartition(" - at `$.")
    key = key.rstrip("`")
    choices = next((s.choices for s in declared(struct) if s.name == key), ())
    if choices:
        message += f" (choose one of: {', '.join(choices)})"
    return f"{key}: {message}"


class Table(NamedTuple):
    """`settings` as a markdown table in docs/operations.md, between markers
    naming `module`, whose `python -m` rewrites it there."""

    module: str
    settings: tuple[Setting, ...]
    keys: bool = True  # a column of TOML keys (a command without a config file has none)

    @property
    def start(self) -> str:
        return f"<!-- settings: from {self.module}; `python -m {self.module} docs/operations.md` rewrites them -->"

    @property
    def end(self) -> str:
        return f"<!-- end of settings from {self.module} -->"

    def markdown(self) -> str:
        key = ("key",) if self.keys else ()
        rows = ["| " + " | ".join((*key, "option", "default", "meaning")) + " |"]
        rows.append("|" + " --- |" * (len(key) + 3))
        for s in self.settings:
            option = f"`{s.option}`" if s.option else ""
            option += f" (${s.envvar})" if s.envvar else ""
            cells = ((f"`{s.name}`",) if self.keys else ()) + (option, s.default, s.help)
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join(rows)

    def rewrite(self, text: str) -> str:
        """`text` with the table between its markers made anew from the
        declarations, so the docs cannot drift from the code."""
        head, start, rest = text.partition(self.start)
        _, end, tail = rest.partition(self.end)
        if not end:
            raise ValueError(f"no settings table marked {self.start!r} ... {self.end!r}")
        return f"{head}{start}\n{self.markdown()}\n{end}{tail}"

    def main(self, argv: list[str]) -> None:
        """`python -m MODULE docs/operations.md`: rewrite the table there."""
        if len(argv) != 2:
            sys.exit(f"usage: python -m {self.module} docs/operations.md")
        docs = Path(argv[1])
        docs.write_text(self.rewrite(docs.read_text()))
