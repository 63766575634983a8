import sys

from spmdkit.cli import main

sys.exit(main())
