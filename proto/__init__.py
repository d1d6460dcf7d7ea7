"""kvserve.proto."""
