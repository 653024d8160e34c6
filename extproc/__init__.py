"""An Envoy external-processing router for LLM inference pools."""

import os

__version__ = "0.1.0"

# We start Envoy (and tests start engines) as child processes while gRPC's threads run. With gRPC's
# fork support on, a forked child that has not exec'd yet can abort in gRPC's at-fork handlers
# ("epoll_wait error: Bad file descriptor", exit -6). We never fork a process to keep using gRPC
# in it, so switch the handlers off before anything imports grpc: every grpc import in this
# package comes after this line.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
