"""The device-neutral core every backend builds on (``docs/backends.md``)."""
