"""``python -m ckpt_engine.server``: the same as the ``ckpt-engine`` command."""

import sys

from ckpt_engine.server.cli import main

sys.exit(main())
