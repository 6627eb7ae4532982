"""The parameter plane (PLANE=chain; docs/design-scale.md): a round's vectors move node to node
along routes the global server plans, instead of through the server.

- ``route.py``: the routes (pure): plans, bypasses, epochs, a receiver's contiguous prefix;
- ``wire.py``: the data connection that carries one vector between two nodes;
- ``node.py``: a node's data listener, and its part of a broadcast or a reduce;
- ``messages.py``: routes on the control wire (``DataRoute``), and the checks of both sides.
"""
