"""splitserve's contracts: the code protoc generates from `protos/`, and the rules that go with it.

    common/v1, core/v1, frontend/v1, worker/v1   generated messages, gRPC stubs and type stubs
                                                 (`make proto`; never edited by hand)

Nothing here imports another splitserve package: every service, the runtime plumbing and the
user-facing `splitserve` package sit above the contracts.
"""
