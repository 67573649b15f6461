"""``python -m tensorwire``: the ``tensorwire`` command (``doctor``, ``bench``) without the console script."""

import sys

from .cli import main

sys.exit(main())
