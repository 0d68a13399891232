import sys

from turnout.cli.main import main

sys.exit(main())
