"""Streaming multi-turn chat with the sync client.

    kvmux serve &                       # in another terminal
    python clients/python/examples/chat.py [ENDPOINT]

ENDPOINT defaults to the local daemon (KVMUX_ENDPOINT or the runtime dir's
ipc socket); pass tcp://host:port for a remote one.
"""

import sys

from kvmux.client import Client, KvmuxError, Overloaded

endpoint = sys.argv[1] if len(sys.argv) > 1 else None

with Client(endpoint, timeout=60) as client:
    try:
        session = client.open_session(system="You are a concise assistant.", max_tokens=48)
    except Overloaded as exc:
        sys.exit(f"daemon full ({exc.reason}); retry in {exc.retry_after_s or 1}s")
    with session:
        for question in ("What is the capital of France?", "And of Italy?"):
            print(f"> {question}")
            stream = session.chat(question)
            try:
                for chunk in stream:
                    print(chunk.text, end="", flush=True)
            except KeyboardInterrupt:
                stream.close()  # cancels the reply; the session stays usable
            r = stream.result
            print(
                f"\n[{r.stop_reason}: {r.prompt_tokens} prompt tokens in {r.prefill_s:.2f}s, "
                f"{r.completion_tokens} tokens in {r.decode_s:.2f}s]"
            )
        # Cancel: stop after the first few chunks.
        stream = session.chat("Count from one to fifty in words.")
        for i, chunk in enumerate(stream):
            print(chunk.text, end="", flush=True)
            if i == 4:
                break
        stream.close()
        print(f" ... [{stream.result.stop_reason}]")
        info = session.info()
        print(
            f"history {info.history_tokens} tokens, KV {info.kv_live_bytes / 1e6:.1f} MB live of {info.slab_bytes / 1e6:.1f} MB"
        )
    try:
        session.info()
    except KvmuxError as exc:  # closed: SessionNotFound
        print(f"after close: {type(exc).__name__}: {exc}")
