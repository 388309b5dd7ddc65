"""creation ops (being declared)."""
