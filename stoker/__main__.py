import sys

from stoker.cli import main

sys.exit(main())
