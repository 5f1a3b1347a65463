"""controller (see docs/DESIGN)."""
