import sys

from devstack.cli import main

sys.exit(main())
