"""layout ops (being declared)."""
