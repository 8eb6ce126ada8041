"""``python -m lwm``: the ``lwm`` command."""

import sys

from lwm.cli import main

sys.exit(main())
