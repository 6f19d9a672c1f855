import sys

from ovpipe.cli import main

sys.exit(main())
