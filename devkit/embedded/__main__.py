"""``python -m devkit.embedded``: runs ``devkit.embedded.main``; nothing else."""

from __future__ import annotations

import sys

from devkit.embedded.command import main

if __name__ == "__main__":
    sys.exit(main())
