"""The environment variables that describe a gRPC world: what `collectives.launch` (or a user's
own launcher) sets for every rank, what `init()` looks for to choose gRPC, and what the gRPC
transport's configuration reads. One definition, for a module that imports nothing heavy: `init()`
is imported with the package, the gRPC configuration (ssl, sockets) only when a world starts."""

ENV_RANK = "COLLECTIVES_RANK"
ENV_WORLD_SIZE = "COLLECTIVES_WORLD_SIZE"
ENV_ADDRESSES = "COLLECTIVES_ADDRESSES"
"""Comma-separated host:port of every rank, in rank order."""
ENV_SECRET = "COLLECTIVES_SECRET"
"""Shared secret every rank proves it holds; it never travels (docs/security.md)."""
