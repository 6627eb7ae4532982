"""The parameter plane (issue 15, docs/design-scale.md): routes between nodes. In progress:
only the pure route planning (``route.py``) exists; the node loop still uses the star."""
