"""deadpool-ctl, an operator's entry point (``python -m deadpool_ext.ctl``
or the ``deadpool-ctl`` command): the client lives in ``control.ctl``."""

import sys

from deadpool_ext.control.ctl import main

if __name__ == "__main__":
    sys.exit(main())
