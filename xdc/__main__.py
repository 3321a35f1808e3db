import sys

from xdc.cli import main

sys.exit(main())
