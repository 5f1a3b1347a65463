"""train (see docs/DESIGN)."""
