"""kvbridge control-plane services."""
