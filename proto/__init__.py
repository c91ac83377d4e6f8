"""The gRPC API: v1/shoal.proto (the source of truth) and its generated
Python stubs (`make proto` regenerates them)."""
