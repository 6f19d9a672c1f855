import sys

from pretrain.plan import main

sys.exit(main())
