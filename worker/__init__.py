"""kvserve.worker."""
