"""Example agents used by the README and ``lousho demo``."""
