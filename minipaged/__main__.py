import sys

from minipaged.entrypoints.cli import main

sys.exit(main())
