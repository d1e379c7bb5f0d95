"""Development tools: embedded PostgreSQL and Redis, the ``lousho dev`` server and the ``lousho demo`` run.

Nothing here produces or runs work in production. The ``lousho`` command imports this package for its
``dev`` and ``demo`` commands; ``store``, ``worker`` and the client library never do. Modules:
``embedded`` (the servers), ``devserver`` and ``supervisor`` (``lousho dev``), ``demo``, ``errors``.
Nothing is re-exported here, so that ``python -m devkit.embedded`` loads neither Celery nor the client.
"""

from __future__ import annotations
