"""Golden msgpack vectors: the checked-in bytes are what msgspec encodes
today, decode back to the same bytes, and cover every frame type. The Node
suite runs the same vectors (clients/typescript/test/vectors.test.ts)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from kvmux import protocol as p

VECTORS = Path(__file__).resolve().parent.parent / "protocol" / "vectors"
MANIFEST = json.loads((VECTORS / "manifest.json").read_text())["vectors"]


def _load_maker():
    spec = importlib.util.spec_from_file_location("make_vectors", VECTORS / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _load_maker()


def test_vectors_are_current():
    """A schema change that alters any encoding (or the TS field tables)
    must come with regenerated vectors, which then fail the other suite."""
    assert maker.main(["--check"]) == 0, "run: python protocol/vectors/make_vectors.py"


def test_every_frame_type_has_vectors():
    covered = {v["schema"] for v in MANIFEST}
    # structs only ever nested in another are covered inside the vectors that carry them
    assert covered >= set(maker.SCHEMAS) - {
        "ChatMessage",
        "Sampling",
        "WorkerStats",
        "SessionSummary",
        "Refused",
        "ModelStats",
        "Endpoint",
        "ToolCall",
        "Tool",
        "NamedTool",
        "Fork",
        "Format",
        "TokenLogprob",
        "Logprobs",
        "ToolCallDelta",
        "PrefixCounts",
    }
    assert {v["value"]["code"] for v in MANIFEST if v["schema"] == "Error"} == {c.value for c in p.ErrorCode}
    assert {v["value"][1] for v in MANIFEST if v["schema"] == "Envelope"} >= {
        v for k, v in vars(p.Op).items() if k.isupper()
    }


@pytest.mark.parametrize("vector", MANIFEST, ids=[v["name"] for v in MANIFEST])
def test_vector_round_trip(vector):
    raw = (VECTORS / vector["file"]).read_bytes()
    cls = maker.SCHEMAS[vector["schema"]]
    # bytes -> Struct -> bytes
    decoded = msgspec.msgpack.decode(raw, type=cls)
    assert p.encode(decoded) == raw
    # the JSON value -> Struct -> the same bytes, and it equals the decoded one
    built = msgspec.convert(maker.from_json(vector["value"]), type=cls)
    assert built == decoded
    assert p.encode(built) == raw


@pytest.mark.parametrize(
    "vector",
    [v for v in MANIFEST if v["schema"] in maker.SCHEMAS and maker.SCHEMAS[v["schema"]] in p.ReplyBody.__args__],
    ids=lambda v: v["name"],
)
def test_reply_vectors_decode_through_the_union(vector):
    raw = (VECTORS / vector["file"]).read_bytes()
    assert type(p.decode_reply(raw)).__name__ == vector["schema"]


@pytest.mark.parametrize("vector", [v for v in MANIFEST if v["schema"] == "Envelope"], ids=lambda v: v["name"])
def test_envelope_vectors_decode_with_the_codec(vector):
    env = p.decode_envelope((VECTORS / vector["file"]).read_bytes())
    assert [env.version, env.op, env.request_id, env.session_id] == maker.from_json(vector["value"])


def test_integral_float_is_encoded_as_float64():
    """temperature=1.0 must be a msgpack float64 on the wire (a JS client
    holding the number 1 must not send an int)."""
    raw = (VECTORS / "generate_full.msgpack").read_bytes()
    assert b"\xabtemperature\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00" in raw
