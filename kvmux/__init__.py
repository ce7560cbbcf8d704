"""kvmux: a session-bound LLM runtime (ZeroMQ broker, MLX workers, KV slabs)."""

__version__ = "0.1.0"
