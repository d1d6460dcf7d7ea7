"""kvserve.bench."""
