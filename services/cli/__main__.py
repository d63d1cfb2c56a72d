import sys

from diloco.services.cli import main

sys.exit(main())
