import sys

from frontend_svc.main import main

sys.exit(main())
