"""Worker processes with a 4-second broker visibility timeout, for the redelivery test (RELIABILITY C3).

Loaded through ``LOUSHO_AGENTS`` next to ``tests.support.agents``: at ``worker_init``, before the consumer
connects. The production configuration refuses a visibility timeout below twice the step time limit (a step
still running would be delivered again); this module sets one after that check on purpose, so the test can
watch the broker redeliver a running step and see the lease turn the copy away.
"""

from __future__ import annotations

import os

ENV = "LOUSHO_TEST_VISIBILITY_S"

if os.environ.get(ENV):
    from worker.celery import app

    seconds = float(os.environ[ENV])
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        "visibility_timeout": seconds,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
    app.conf.result_backend_transport_options = {"visibility_timeout": seconds}
