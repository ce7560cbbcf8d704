"""`kvmux bench agent`: an agent's tool loop through `kvmux http` against
`mlx_lm.server` (the same model: an mlx-lm directory exported from the
embedded GGUF, as `kvmux bench peers` runs it), and what constrained
decoding costs the worker, in one run.

- loop: a scripted agent of `steps` requests per server, each one
  `chat.completions.create` with three tools (JSON-schema parameters), the
  whole conversation so far as an agent framework sends it, a short greedy
  reply. A reply with tool calls is appended with one scripted tool result
  per call; a reply without is appended with a scripted next user message
  ("Now use the tool for ..."). kvmux gets `tool_choice="required"` on even
  steps (its grammar makes that a call) and "auto" on odd ones, one call a
  step (`parallel_tool_calls` false);
  mlx_lm.server has no tool_choice and gets the same request without it
  (its own tool parsing applies where the model's template has one). The
  two servers' replies differ, so each runs its own conversation. Per step:
  latency, prompt, cached and completion tokens, the calls and whether their
  arguments parse as JSON. A call whose arguments do not parse is not sent
  back as a call (a server would refuse it); its step counts as a text reply.
  A request that fails is recorded and the loop goes on.
- constraint: through the Python client, decode tokens/s of the same prompt
  with and without a JSON schema (`format=`), interleaved pairs in fresh
  sessions, speculative off: the tokens/s ratio (median, min-max) and the
  mask's cost per token (the difference of per-token decode times). Then one
  pair off/auto on a prompt whose JSON copies a given record, with and
  without the schema: whether lookup proposals stay useful under a grammar
  (accepted/drafted).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from . import spawn
from .peers import SPECULATIVE, export_mlx_dir, http_gateway, mlx_lm_server
from .plot import save
from .report import ReportWriter, percentile, ratio_summary

SERVERS = ("kvmux", "mlx_lm")
MODEL_NAME = {"kvmux": "kvmux", "mlx_lm": "default_model"}  # mlx_lm.server: the model it was started with

SYSTEM = "You are a helpful assistant. Use the tools to answer; call one tool at a time."
TASK = "Find the weather in Paris, add 17 and 25, and look up the key 'alpha'. Use one tool per step."
NEXT = [
    "Now use the tool for the weather in Paris.",
    "Now use the tool to add 17 and 25.",
    "Now use the tool to look up the key 'alpha'.",
    "Now use the tool for the weather in Tokyo.",
    "Now use the tool to add 1234 and 4321.",
    "Now use the tool to look up the key 'gamma'.",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city's name."}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up in the team's notes.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}},
                "required": ["key"],
                "additionalProperties": False,
            },
        },
    },
]
NOTES = {"alpha": "the launch is on Tuesday", "beta": "budget approved", "gamma": "ask Dana about the keys"}
SKIES = ("sunny", "cloudy", "rain")

SCHEMA = {  # bounded strings and list: a 135M model given room repeats an item until max_tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "bio": {"type": "string", "maxLength": 240},
    },
    "required": ["name", "age", "city", "hobbies", "bio"],
    "additionalProperties": False,
}
PROMPT = (
    "Invent a person and describe them as a JSON object with the keys name, age, city, "
    "hobbies (a list of strings) and bio (a few sentences)."
)
COPY_PROMPT = (
    "Convert this record to a JSON object with the keys name, age, city, hobbies (a list) and bio, "
    "copying the values exactly:\n\nname: Ada Lovelace\nage: 36\ncity: London\n"
    "hobbies: mathematics, poetry, horse riding\nbio: Ada wrote the first published algorithm for "
    "Charles Babbage's Analytical Engine and foresaw that such machines could compose music and "
    "work with symbols, not only numbers."
)


@dataclass
class AgentConfig:
    steps: int = 30
    max_tokens: int = 48
    servers: tuple[str, ...] = SERVERS
    constraint_reps: int = 5
    constraint_tokens: int = 96


# ------------------------------------------------------------------ the loop


def tool_result(name: str, args: dict) -> str:
    """The scripted tool: a deterministic answer for any arguments."""
    if name == "get_weather":
        city = str(args.get("city", ""))
        code = sum(map(ord, city))
        return json.dumps({"city": city, "temp_c": 5 + code % 20, "sky": SKIES[code % len(SKIES)]})
    if name == "add":
        try:
            return json.dumps({"sum": float(args["a"]) + float(args["b"])})
        except (KeyError, TypeError, ValueError):
            return json.dumps({"error": "add needs two numbers a and b"})
    if name == "lookup":
        key = str(args.get("key", ""))
        return json.dumps({"key": key, "value": NOTES.get(key, f"no note for {key!r}")})
    return json.dumps({"error": f"no function {name!r}"})


def _arguments(text: str | None) -> dict | None:
    """A call's arguments as a JSON object, or None when they are not one."""
    try:
        args = json.loads(text or "")
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


class Agent:
    """One server's conversation: the whole of it goes out every step."""

    def __init__(self, server: str, url: str, max_tokens: int):
        import openai

        self.server, self.max_tokens = server, max_tokens
        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused-on-loopback", max_retries=0, timeout=600)
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        self.texts = 0  # replies without a call so far: picks the next scripted user message

    def request(self, step: int) -> dict:
        kwargs: dict = {
            "model": MODEL_NAME[self.server],
            "messages": self.messages,
            "tools": TOOLS,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if self.server == "kvmux":
            kwargs["tool_choice"] = self.tool_choice(step)
            kwargs["parallel_tool_calls"] = False  # one call a step: the 135M model repeats calls given the room
            kwargs["extra_body"] = {"speculative": SPECULATIVE}  # like for like: mlx_lm.server does not speculate
        return kwargs

    def tool_choice(self, step: int) -> str | None:
        if self.server != "kvmux":
            return None  # mlx_lm.server has none
        return "required" if step % 2 == 0 else "auto"

    def step(self, step: int) -> dict:
        row: dict = {"step": step, "messages": len(self.messages), "tool_choice": self.tool_choice(step)}
        started = time.perf_counter()
        try:
            completion = self.api.chat.completions.create(**self.request(step))
        except Exception as exc:  # any failure of one step is data, not the end of the run
            row |= {"latency_s": round(time.perf_counter() - started, 4), "error": f"{type(exc).__name__}: {exc}"[:500]}
            self._text_reply("")
            return row
        row["latency_s"] = round(time.perf_counter() - started, 4)
        usage = completion.usage
        details = getattr(usage, "prompt_tokens_details", None) if usage else None
        cached = getattr(details, "cached_tokens", None)
        prompt = usage.prompt_tokens if usage else None
        row |= {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_tokens": prompt - (cached or 0) if prompt is not None else None,
            "completion_tokens": usage.completion_tokens if usage else None,
        }
        choice = completion.choices[0]
        message = choice.message
        calls = []
        for call in message.tool_calls or ():
            function = getattr(call, "function", None)
            name, arguments = (function.name, function.arguments) if function else (None, None)
            args = _arguments(arguments)
            calls.append({"id": call.id, "name": name, "arguments": arguments, "parsed": args})
        known = {t["function"]["name"] for t in TOOLS}
        row |= {
            "finish_reason": choice.finish_reason,
            "content": (message.content or "")[:300],
            "tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls],
            "has_tool_calls": bool(calls),
            "arguments_json": all(c["parsed"] is not None for c in calls) if calls else None,
            "valid_calls": sum(c["parsed"] is not None and c["name"] in known for c in calls),
        }
        usable = [c for c in calls if c["parsed"] is not None]
        if usable:
            self.messages.append(
                {
                    "role": "assistant",
                    "content": message.content or None,
                    "tool_calls": [
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in usable
                    ],
                }
            )
            for c in usable:
                self.messages.append(
                    {"role": "tool", "tool_call_id": c["id"], "content": tool_result(c["name"], c["parsed"])}
                )
        else:
            self._text_reply(message.content or "")
        return row

    def _text_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.messages.append({"role": "user", "content": NEXT[self.texts % len(NEXT)]})
        self.texts += 1


def loop(server: str, url: str, cfg: AgentConfig, rows: list[dict], progress: bool, checkpoint: Callable) -> None:
    """The scripted loop on one server; each step's row goes into `rows` as it ends."""
    agent = Agent(server, url, cfg.max_tokens)
    for step in tqdm(range(1, cfg.steps + 1), desc=f"{server} agent loop", unit="step", disable=not progress):
        rows.append(agent.step(step))
        checkpoint()


def template_has_tool_calling(model_dir: Path) -> bool | None:
    """Whether mlx_lm.server finds a tool-call format in the model's template."""
    try:
        from mlx_lm.utils import load_tokenizer

        return bool(load_tokenizer(model_dir).has_tool_calling)
    except Exception:  # an mlx-lm without it: unknown
        return None


# ------------------------------------------------------------ constraint


def _generate(client, prompt: str, max_tokens: int, schema: bool, speculative: str) -> dict:
    """One reply in a fresh session: the worker's own decode timing."""
    from kvmux.protocol import Format

    options = {"format": Format(type="json_schema", schema=SCHEMA)} if schema else {}
    try:
        with client.open_session() as session:
            stream = session.generate(
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0.0,
                speculative=speculative,
                **options,
            )
            text = "".join(chunk.text for chunk in stream)
            r = stream.result
    except Exception as exc:  # recorded; the pair is left out of the ratios
        return {"schema": schema, "speculative": speculative, "error": f"{type(exc).__name__}: {exc}"[:500]}
    tokens = r.completion_tokens
    try:
        json_ok = isinstance(json.loads(text), dict)
    except ValueError:
        json_ok = False
    return {
        "schema": schema,
        "speculative": speculative,
        "completion_tokens": tokens,
        "decode_s": round(r.decode_s, 4),
        "prefill_s": round(r.prefill_s, 4),
        "tokens_per_s": round(tokens / r.decode_s, 3) if r.decode_s and tokens else None,
        "us_per_token": round(1e6 * r.decode_s / tokens, 1) if tokens else None,
        "drafted_tokens": r.drafted_tokens,
        "accepted_tokens": r.accepted_tokens,
        "stop_reason": str(r.stop_reason),
        "json_object": json_ok,
        "text": text[:400],
    }


def _ok(run: dict) -> bool:
    return not run.get("error") and bool(run.get("tokens_per_s"))


def constraint(client, cfg: AgentConfig, block: dict, progress: bool, checkpoint: Callable) -> None:
    """Interleaved (plain, schema) pairs, the order alternating; then off/auto
    pairs on the record-copying prompt, with and without the schema; into `block`."""
    block |= {"pairs": [], "speculative": {}}
    for rep in tqdm(range(cfg.constraint_reps), desc="constraint pairs", unit="pair", disable=not progress):
        order = (False, True) if rep % 2 == 0 else (True, False)
        runs = {schema: _generate(client, PROMPT, cfg.constraint_tokens, schema, "off") for schema in order}
        block["pairs"].append({"plain": runs[False], "schema": runs[True]})
        checkpoint()
    for schema in (True, False):
        runs = {mode: _generate(client, COPY_PROMPT, cfg.constraint_tokens, schema, mode) for mode in ("off", "auto")}
        block["speculative"]["schema" if schema else "plain"] = runs


def _constraint_summary(block: dict) -> dict:
    pairs = block.get("pairs", [])
    good = [p for p in pairs if _ok(p["plain"]) and _ok(p["schema"])]
    out: dict = {"pairs": len(pairs), "pairs_measured": len(good)}
    if good:
        out["tokens_per_s_schema_vs_plain"] = ratio_summary(
            [(p["plain"]["tokens_per_s"], p["schema"]["tokens_per_s"]) for p in good]
        )
        mask = [p["schema"]["us_per_token"] - p["plain"]["us_per_token"] for p in good]
        out["mask_us_per_token"] = {
            "median": round(statistics.median(mask), 1),
            "min": round(min(mask), 1),
            "max": round(max(mask), 1),
        }
        out["schema_replies_json"] = sum(bool(p["schema"]["json_object"]) for p in good)
        out["plain_replies_json"] = sum(bool(p["plain"]["json_object"]) for p in good)
    errors = [r["error"] for p in pairs for r in p.values() if r.get("error")]
    if errors:
        out["errors"] = len(errors)
        out["first_error"] = errors[0]
    spec = {}
    for name, runs in block.get("speculative", {}).items():
        off, auto = runs.get("off", {}), runs.get("auto", {})
        if not (_ok(off) and _ok(auto)):
            spec[name] = {"error": off.get("error") or auto.get("error") or "no tokens"}
            continue
        drafted = auto["drafted_tokens"]
        spec[name] = {
            "tokens_per_s_off": off["tokens_per_s"],
            "tokens_per_s_auto": auto["tokens_per_s"],
            "speedup": round(auto["tokens_per_s"] / off["tokens_per_s"], 3),
            "drafted_tokens": drafted,
            "accepted_tokens": auto["accepted_tokens"],
            "acceptance": round(auto["accepted_tokens"] / drafted, 3) if drafted else None,
        }
    out["speculative"] = spec
    return out


# ---------------------------------------------------------------- report


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


def _loop_summary(rows: list[dict]) -> dict:
    done = [r for r in rows if not r.get("error")]
    latency = [r["latency_s"] for r in done]
    calls = sum(len(r["tool_calls"]) for r in done)
    prompt = sum(r["prompt_tokens"] or 0 for r in done)
    cached = sum(r["cached_tokens"] or 0 for r in done)
    required = [r for r in done if r.get("tool_choice") == "required"]
    out = {
        "steps": len(rows),
        "errors": len(rows) - len(done),
        "latency_p50_s": _round(percentile(latency, 50)),
        "latency_p90_s": _round(percentile(latency, 90)),
        "prompt_tokens_total": prompt,
        "cached_tokens_total": cached,
        "prefill_tokens_total": prompt - cached,
        "completion_tokens_total": sum(r["completion_tokens"] or 0 for r in done),
        "steps_with_tool_calls": sum(r["has_tool_calls"] for r in done),
        "tool_calls": calls,
        "valid_call_fraction": round(sum(r["valid_calls"] for r in done) / calls, 3) if calls else None,
    }
    if required:
        out["required_steps_with_call"] = f"{sum(r['has_tool_calls'] for r in required)}/{len(required)}"
    if len(done) < len(rows):
        out["first_error"] = next(r["error"] for r in rows if r.get("error"))
    return out


def summarize(doc: dict) -> dict:
    out: dict = {}
    for server in SERVERS:
        if server in doc:
            out[server] = _loop_summary(doc[server]["steps"])
    k, m = out.get("kvmux"), out.get("mlx_lm")
    if k and m and k["latency_p50_s"] and m["latency_p50_s"]:
        out["mlx_lm_vs_kvmux"] = {
            "latency_p50": round(m["latency_p50_s"] / k["latency_p50_s"], 3),
            "prefill_tokens": round(m["prefill_tokens_total"] / k["prefill_tokens_total"], 3)
            if k["prefill_tokens_total"]
            else None,
        }
    if "constraint" in doc:
        out["constraint"] = _constraint_summary(doc["constraint"])
    return out


def run(cfg: AgentConfig, output: Path, model_dir: Path, progress: bool = True) -> dict:
    from kvmux.client import Client

    writer = ReportWriter(output, "agent", asdict(cfg), prepare=lambda: doc.update(summary=summarize(doc)))
    doc = writer.doc
    if "kvmux" in cfg.servers:
        with spawn.daemon(slabs=4) as daemon:
            with http_gateway(daemon.frontend) as url:
                doc["kvmux"] = {"steps": []}
                loop("kvmux", url, cfg, doc["kvmux"]["steps"], progress, writer.checkpoint)
                writer.write()
            if cfg.constraint_reps > 0:
                doc["constraint"] = {}
                with Client(daemon.frontend, timeout=600) as client:
                    constraint(client, cfg, doc["constraint"], progress, writer.checkpoint)
                writer.write()
    if "mlx_lm" in cfg.servers:
        model_dir = export_mlx_dir(model_dir)
        with mlx_lm_server(model_dir, cfg.max_tokens) as (url, _pid):
            doc["mlx_lm"] = {"template_has_tool_calling": template_has_tool_calling(model_dir), "steps": []}
            loop("mlx_lm", url, cfg, doc["mlx_lm"]["steps"], progress, writer.checkpoint)
        writer.write()
    writer.write("done")
    return doc


LABELS = {"kvmux": "kvmux http (tool_choice required/auto)", "mlx_lm": "mlx_lm.server (prompt cache)"}


def plot(doc: dict, path: Path) -> Path:
    """Per-step latency and prefilled tokens of each server; filled markers
    are steps whose reply made a tool call."""
    import matplotlib.pyplot as plt

    fig, (lat, pre) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (server, label), color in zip(LABELS.items(), ("tab:blue", "tab:orange"), strict=True):
        rows = [r for r in (doc.get(server) or {}).get("steps", []) if r.get("prefill_tokens") is not None]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        lat.plot(steps, [r["latency_s"] for r in rows], "-", lw=0.8, color=color, label=label)
        pre.plot(steps, [r["prefill_tokens"] for r in rows], "-", lw=0.8, color=color, label=label)
        called = [r for r in rows if r["has_tool_calls"]]
        lat.plot([r["step"] for r in called], [r["latency_s"] for r in called], "o", ms=4, color=color)
        pre.plot([r["step"] for r in called], [r["prefill_tokens"] for r in called], "o", ms=4, color=color)
    cfg = doc.get("config", {})
    lat.set(xlabel="step", ylabel="request latency (s)", title=f"Tool loop, {cfg.get('max_tokens')}-token replies")
    pre.set(xlabel="step", ylabel="prefilled tokens (prompt - cached)", title="Prefill per step (o: tool call)")
    for ax in (lat, pre):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle("kvmux bench agent")
    return save(fig, path)
