import sys

from pipeline.cli.app import main

sys.exit(main())
