import sys

from splitserve_runtime.log_limits import quiet_grpc_core_logs

quiet_grpc_core_logs()  # before grpc is imported

from core_svc.main import main  # noqa: E402

sys.exit(main())
