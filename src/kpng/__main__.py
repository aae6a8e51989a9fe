import sys

from kpng.cli import main

sys.exit(main())
