"""Transports: the point-to-point contract (`base`) and its implementations.

Concrete backends are imported only when asked for, so that a missing optional dependency
(mpi4py, grpcio, cupy) costs nothing until that backend is used.
"""
