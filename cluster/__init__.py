"""kvserve.cluster."""
