import sys

from runlm.cli import main

sys.exit(main())
