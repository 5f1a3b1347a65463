"""teacher (see docs/DESIGN)."""
