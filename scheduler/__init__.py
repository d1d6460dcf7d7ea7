"""The control plane: block hashing, the block pool, the KV-cache manager and the step scheduler.

Plain Python: nothing here imports torch, Ray or gRPC.
"""
