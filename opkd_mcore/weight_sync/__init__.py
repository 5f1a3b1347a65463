"""weight_sync (see docs/DESIGN)."""
