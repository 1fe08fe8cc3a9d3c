"""``python -m bdlora.cli`` (how ``bdlora train --nproc`` relaunches itself under torchrun)."""

import sys

from bdlora.cli import main

sys.exit(main())
