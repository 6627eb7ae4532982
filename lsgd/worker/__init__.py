"""The worker side: the client a training loop uses, and parameter adapters."""

from .client import Worker

__all__ = ["Worker"]
