"""What every algorithm stands on: the `Group` view of the transport, tags, step machines and their
drivers, buffer layout, reduction operators, and the link-cost primitives cost functions are built
from. Imports only `collectives.backends`."""
