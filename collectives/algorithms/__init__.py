"""The collective algorithms, one module each, and the registry that lists them.

Algorithms import only `collectives.core`; they never import selection code or the front end.
"""
