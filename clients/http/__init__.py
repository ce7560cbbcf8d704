"""`kvmux http`: an OpenAI-compatible HTTP gateway, one more thin client of
the broker (the asyncio client; no MLX). Each conversation is bound to a
live kvmux session, so a client that re-sends the whole history on every
turn costs the worker only the new message (clients/http/binding.py)."""
