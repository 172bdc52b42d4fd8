"""``python -m ckpt_engine.cli``: the same as the ``ckpt-engine`` command."""

import sys

from ckpt_engine.cli.main import main

sys.exit(main())
