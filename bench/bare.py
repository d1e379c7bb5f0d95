"""The baseline: a bare Celery chain whose every hop only enqueues the next one.

The app gets exactly the Lousho worker's Celery configuration (``worker.celery.configure``: JSON
only, ``acks_late`` with ``reject_on_worker_lost``, prefetch 1, the same broker transport options
and time limits) on its own queue, so the difference measured against Lousho is the step's own
work: lease, claim-and-load, model or tool call, fenced save, release. With ``--result-bytes N`` every
hop's message carries a payload of N bytes (the tool result's size), which the hop passes on to the next
one unchanged: the broker, serialization and delivery costs of the data grow with N as in Lousho.

Start a worker with ``celery -A bench.bare worker -Q <queue>`` and ``LOUSHO_QUEUE=<queue>``. With
``BENCH_FLOOR`` set, each hop first makes a strict Lousho step's round trips (``bench.floor``).
"""

from __future__ import annotations

from celery import Celery

from bench import floor, timing
from store.settings import Settings
from worker.celery import check_configuration, configure

HOP = "bench.hop"


def make_app(settings: Settings) -> Celery:
    """A Celery app with Lousho's production configuration, on ``settings.queue``, with the hop task."""
    bare = Celery("bench-bare", set_as_current=False)
    configure(bare, settings)
    bare.conf.beat_schedule = {}
    check_configuration(bare)
    handed_over = floor.enabled()

    @bare.task(name=HOP, ignore_result=True)  # type: ignore[untyped-decorator]  # celery is untyped
    def hop(chain: str, n: int, total: int, payload: str = "") -> None:
        """Hop ``n`` of ``total`` of chain ``chain``: enqueue the next hop with the same payload.

        That is all a hop of the bare chain does; the floor's hop first saves itself fenced under a lease
        (``bench.floor``).
        """
        if handed_over:
            floor.hop(chain, n, payload, settings)
        if n < total:
            hop.apply_async((chain, n + 1, total, payload))

    return bare


app = make_app(Settings())
timing.install()
