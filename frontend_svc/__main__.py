from splitserve_runtime.log_limits import quiet_grpc_core_logs

quiet_grpc_core_logs()  # before grpc is imported

from frontend_svc.main import main  # noqa: E402
from splitserve_runtime.process_exit import exit_now  # noqa: E402

exit_now(main())  # a clean return skips the interpreter's teardown
