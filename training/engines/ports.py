"""A free TCP port, for every process asyncrl starts that listens: embedded and SGLang rollout
servers, the Prometheus port of an SGLang engine, torch.distributed rendezvous (Megatron ranks,
the NCCL weight-sync group). One small module so that engines of every backend share it without
importing one another."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago (bind to 0, read it, release it). Another
    process may take it before the caller binds; callers that start a server retry on a bind
    failure."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
