import sys

from zipage.cli.parser import main

sys.exit(main())
