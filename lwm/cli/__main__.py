"""``python -m lwm.cli``: the ``lwm`` command."""

import sys

from lwm.cli.main import main

sys.exit(main())
