import sys

from cpjax.cli import main

sys.exit(main())
