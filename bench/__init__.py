"""The benchmark: Lousho steps/s and per-step overhead against a bare Celery chain on the same broker.

Run it with ``python -m bench`` (see ``bench/README.md``); ``bench.profile_step`` breaks one step's
time down by phase in a single process.
"""
