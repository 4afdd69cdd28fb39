import sys

from minipaged.cli import main

sys.exit(main())
