"""Generated modules of proto package ``disco.v1`` (do not edit; see :mod:`protos.generate`)."""
