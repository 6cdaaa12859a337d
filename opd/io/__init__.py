"""Bytes and files: errors, checked reading, the wire format, the cache and the package registry, plots."""
