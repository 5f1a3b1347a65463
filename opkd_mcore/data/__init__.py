"""data (see docs/DESIGN)."""
