import sys

from diloco.cli import main

sys.exit(main())
