"""`kvmux bench perf`'s `speculative` part: decode tokens/s with speculative
decoding against `speculative=off`, side by side in one run, on three
workloads, at the sessions' window (the serve default unless --window):

- edit: rewrite a given passage or code with one change (the answer repeats
  the prompt);
- agentic: a multi-turn session whose turns quote tool output given in
  earlier turns;
- chat: open-ended prompts.

Each workload runs as interleaved pairs (off, on, off, on, ...) in fresh
sessions, each pair on its own texts; decode tokens/s is the worker's own (completion tokens over the
decode time its replies carry). Reported per workload: the speedup (median,
min, max of on/off), the acceptance rate (accepted / drafted tokens) and
`identical` (greedy tokens equal in every pair). Run once with lookup
drafts, and once with a draft model when one is given (`--draft-model`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvmux.client import Client

from .report import ratio_summary

PASSAGES = [
    "The lighthouse stood on a rock at the edge of the bay. Every night the keeper climbed its one hundred "
    "and twelve steps, trimmed the wick, polished the lens and wound the clockwork that turned the light. "
    "Ships passing in the dark counted its flashes, three short and one long, and knew where they were. "
    "In winter the storms came from the north, and the spray reached the lamp room windows.",
    "The market opened at dawn, when the bakers carried out their first loaves and the fishmongers laid "
    "their catch on beds of ice. By eight the square was full: farmers sold eggs from wicker baskets, a "
    "knife grinder sharpened blades by the fountain, and children chased pigeons between the stalls. "
    "At noon the bell of the town hall rang, and the traders began to pack away.",
]
CODES = [
    '''def load_config(path, defaults=None):
    """Read a TOML config file and merge it over the defaults."""
    defaults = dict(defaults or {})
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            defaults[key] = {**defaults[key], **value}
        else:
            defaults[key] = value
    return defaults
''',
    '''def parse_line(line, separator=","):
    """Split one CSV line into stripped fields, dropping empty ones."""
    fields = []
    for raw in line.split(separator):
        field = raw.strip()
        if field:
            fields.append(field)
    if not fields:
        raise ValueError("empty line")
    return fields
''',
]
FILES = [
    [(1834, "broker.py"), (912, "codec.py"), (4410, "engine.py"), (377, "__init__.py"), (2291, "scheduler.py")],
    [(650, "stops.py"), (3120, "slab.py"), (2840, "lookup.py"), (145, "py.typed"), (5012, "attention.py")],
]
CHAT = [
    "Write a short story about a fox who finds a lantern.",
    "Explain how a bicycle stays upright, in a few paragraphs.",
    "Give five ideas for a rainy weekend.",
    "Describe the life of a honey bee through a year.",
    "Write a letter from a sailor to his family.",
    "Explain why the sea is salty, at length.",
]


def _listing(files: list[tuple[int, str]]) -> str:
    return "\n".join(f"-rw-r--r-- 1 dev dev {size:>6} Nov 20 10:{i:02d} {name}" for i, (size, name) in enumerate(files))


def edit(pair: int) -> list[list[str]]:
    passage, code = PASSAGES[pair % len(PASSAGES)], CODES[pair % len(CODES)]
    name = code.split("(")[0].removeprefix("def ")
    return [
        [
            f"Rewrite this passage with its first word changed to 'Once', and everything else exactly the same:\n\n{passage}"
        ],
        [f"Rename the function {name} to run and keep the rest of the code exactly the same:\n\n{code}"],
        [f"Repeat this passage exactly, with its last sentence removed:\n\n{passage}"],
    ]


def agentic(pair: int) -> list[list[str]]:
    code, files = CODES[pair % len(CODES)], FILES[pair % len(FILES)]
    name = code.split("(")[0].removeprefix("def ")
    return [
        [
            f"Tool output of `cat util.py`:\n\n{code}\nReply with OK.",
            f"Show the for loop of {name} exactly as it is in the file.",
            f"Tool output of `ls -l`:\n\n{_listing(files)}\nReply with OK.",
            "Quote the lines of the listing for the files larger than 2000 bytes.",
            f"Now show the whole {name} function again, unchanged.",
        ]
    ]


def chat(pair: int) -> list[list[str]]:
    start = 3 * pair % len(CHAT)
    return [[text] for text in (CHAT + CHAT)[start : start + 3]]


def _conversation(client: Client, turns: list[str], mode: str, max_tokens: int, window: int) -> dict:
    """One session through `turns` (each its own user message and reply)."""
    tokens: list[int] = []
    done = {"completion": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0}
    with client.open_session(window=window) as session:
        for text in turns:
            stream = session.chat(text, temperature=0.0, max_tokens=max_tokens, speculative=mode)
            tokens += [t for chunk in stream for t in chunk.token_ids]
            r = stream.result
            done["completion"] += r.completion_tokens
            done["decode_s"] += r.decode_s
            done["drafted"] += r.drafted_tokens
            done["accepted"] += r.accepted_tokens
    return {**done, "tokens": tokens}


def _workload(client: Client, runs: list[list[str]], mode: str, max_tokens: int, window: int) -> dict:
    parts = [_conversation(client, turns, mode, max_tokens, window) for turns in runs]
    total = {k: sum(p[k] for p in parts) for k in ("completion", "decode_s", "drafted", "accepted")}
    return {**total, "tokens": [p["tokens"] for p in parts], "tokens_per_s": total["completion"] / total["decode_s"]}


# Each pair gets its own texts (cycling after two or three pairs): the
# worker-wide lookup would otherwise draft a reply it saw in the last pair.
WORKLOADS: dict[str, Callable[[int], list[list[str]]]] = {"edit": edit, "agentic": agentic, "chat": chat}


def measure(client: Client, mode: str, window: int, pairs: int, max_tokens: int, progress=None) -> dict:
    """Every workload: `pairs` interleaved (off, `mode`) runs."""
    out = {}
    for name, make in WORKLOADS.items():
        measured, drafted, accepted, identical = [], 0, 0, True
        for pair in range(pairs):
            runs = make(pair)
            off = _workload(client, runs, "off", max_tokens, window)
            on = _workload(client, runs, mode, max_tokens, window)
            measured.append((off["tokens_per_s"], on["tokens_per_s"]))
            drafted += on["drafted"]
            accepted += on["accepted"]
            identical = identical and off["tokens"] == on["tokens"]
            if progress:
                progress.update()
        out[name] = {
            "speedup": ratio_summary(measured)["median"],
            "speedup_range": ratio_summary(measured),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "identical": identical,
            "completion_tokens": on["completion"],
        }
    return out
