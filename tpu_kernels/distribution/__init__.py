"""Distribution: build kernel repos into Hub kernel repos, publish them, serve a local Hub, load them back.

Everything here that can run code from a Hub fails closed: the loader imports only what the digest
check verified.
"""
