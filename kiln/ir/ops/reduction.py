"""reduction ops (being declared)."""
