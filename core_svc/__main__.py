import sys

from core_svc.main import main

sys.exit(main())
