"""``python -m streamrl.cli``: the ``streamrl`` command line."""

import sys

from streamrl.cli.main import main

sys.exit(main())
