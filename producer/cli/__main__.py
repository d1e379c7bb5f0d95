"""``python -m producer.cli``: runs ``lousho``; nothing else."""

from __future__ import annotations

import sys

from producer.cli import main

if __name__ == "__main__":
    sys.exit(main())
