"""The collective algorithms, one module each, and the registry that lists the all-reduces.

Algorithms import only `collectives.core` and the registry; they never import selection code or
the front end. Importing this package registers the library's all-reduce algorithms, in the order
`auto` breaks ties in: direct, ring, tree, hierarchical, hierarchical_tree, parameter_server,
reference.
"""

from collectives.algorithms import direct, hierarchical, parameter_server, reference, ring, tree

__all__ = ["direct", "hierarchical", "parameter_server", "reference", "ring", "tree"]
