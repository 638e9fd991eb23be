import sys

from encode_server.cli import main

sys.exit(main())
