"""qklab: control the query-key part of transformer attention."""

__version__ = "0.1.0"
