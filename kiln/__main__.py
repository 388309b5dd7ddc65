"""``python -m kiln``: compile small built-in models, check them against eager, time them."""

from kiln.compiler.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
