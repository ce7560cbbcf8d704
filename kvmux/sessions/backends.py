"""The store a `store` setting names. Beside the interface (store.py),
not in it: the backends subclass the interface, which therefore cannot
import them."""

from __future__ import annotations

from .local import LocalStore
from .store import SessionStore


def open_store(store: str, state_dir: str) -> SessionStore:
    """The store a `store` setting names: a redis://, rediss:// or unix://
    URL, or "" for the directory under `state_dir`."""
    if store.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisStore  # redis-py: only where it is asked for

        return RedisStore(store)
    if store:
        raise ValueError(f"store: {store!r} is not a redis://, rediss:// or unix:// URL (or empty: the state dir)")
    return LocalStore(state_dir)
