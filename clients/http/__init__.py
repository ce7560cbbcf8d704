"""`kvmux http`: an HTTP gateway (OpenAI's chat completions and Responses,
Anthropic's Messages, a page), one more thin client of the broker (the
asyncio client; no MLX). Each conversation is bound to a live kvmux
session, so a client that re-sends the whole history on every turn costs
the worker only the new message (binding.py), and a response id names a
point of one (responses.py); the bindings live with the sessions."""
