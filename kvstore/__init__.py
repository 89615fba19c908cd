"""kvstore daemons: master, worker and the `kvstore` command line."""

from kvstore_client import __version__

__all__ = ["__version__"]
