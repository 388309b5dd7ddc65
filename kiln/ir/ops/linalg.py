"""linalg ops (being declared)."""
