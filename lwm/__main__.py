"""``python -m lwm``: the ``lwm`` command."""

import sys

from lwm.cli.main import main

sys.exit(main())
