"""kvserve.kernels: paged KV-cache writes and paged attention."""
