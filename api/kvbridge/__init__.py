"""kvbridge public API: generated stubs (kvbridge.<api>.v1), errors, hash chain, SDK."""

__version__ = "0.1.0"
