import sys

from edgc.cli import main

sys.exit(main())
