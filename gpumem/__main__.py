import sys

from gpumem.cli import main

sys.exit(main())
