"""Protos of package ``disco``."""
