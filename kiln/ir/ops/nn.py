"""nn ops (being declared)."""
