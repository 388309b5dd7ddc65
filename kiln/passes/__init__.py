"""Graph passes: infrastructure, rewriting and optimizations."""
