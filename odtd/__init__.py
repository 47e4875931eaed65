"""odtd: an on-device continual-learning daemon for embedded boards."""

__version__ = "0.1.0"
