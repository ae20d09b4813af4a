import sys

from ragkv.cli import main

sys.exit(main())
