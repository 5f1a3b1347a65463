"""losses (see docs/DESIGN)."""
